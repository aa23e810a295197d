"""The training and validation samples of an experiment: the synthetic source or megatron indexed datasets,
both indexable, so that a run's data position is one integer (the consumed-sample count) and a resumed run
reads the samples an uninterrupted one would; and the micro-batch sampler.

The synthetic source stands in for a corpus in tests and smoke runs: each sample a pure function of
``(seed, split, i)``, its text a sparse bigram chain with noise, so the loss falls within a few steps.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from repro.config import RunConfig
from repro.errors import ReproError
from repro.training.distributed import barrier

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass(frozen=True)
class SyntheticTokens:
    """Sparse-bigram sequences (+1 token for labels); ``split`` 0/1: independent samples of the seed's table;
    indices wrap at ``num_samples`` (0: never); ``successors`` per token, else uniform with probability ``noise``."""

    vocab_size: int
    seq_length: int
    seed: int = 0
    split: int = 0
    num_samples: int = 0
    successors: int = 4
    noise: float = 0.1

    @functools.cached_property
    def _table(self) -> np.ndarray:
        # The seed's only (not the split's): validation measures the same language.
        rng = np.random.default_rng([self.seed, 0x5EED])
        return rng.integers(0, self.vocab_size, size=(self.vocab_size, self.successors))

    def __len__(self) -> int:
        return self.num_samples if self.num_samples else 2**62

    def _text(self, indices: list[int]) -> np.ndarray:
        """``[b, S + 1]`` int64 texts: sample i's generator ``(seed, split + 1, i)`` draws picks, noise flags, uniform
        tokens; position 0 and noisy ones start a run, others are ``table[previous, pick]`` (filled by depth)."""
        n = self.seq_length + 1
        picks, noisy, uniform = [], [], []
        for index in indices:
            rng = np.random.default_rng([self.seed, self.split + 1, index])
            picks.append(rng.integers(0, self.successors, size=n))
            noisy.append(rng.random(n) < self.noise)
            uniform.append(rng.integers(0, self.vocab_size, size=n))
        pick = np.concatenate(picks)
        starts = np.concatenate(noisy)
        starts[::n] = True  # every sample's first token starts a run
        text = np.where(starts, np.concatenate(uniform), 0).astype(np.int64)
        positions = np.arange(starts.size)
        depth = positions - np.maximum.accumulate(np.where(starts, positions, 0))
        order = np.argsort(depth, kind="stable")
        bounds = np.cumsum(np.bincount(depth))
        table = self._table
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            at = order[lo:hi]
            text[at] = table[text[at - 1], pick[at]]
        return text.reshape(len(indices), n)

    def _check_index(self, index: int) -> int:
        index = int(index)
        if index < 0:
            raise IndexError(index)
        return index % self.num_samples if self.num_samples else index

    def batch(self, indices: Iterable[int]) -> dict[str, torch.Tensor]:
        """Samples ``indices`` stacked as :func:`collate` returns them, each row equal to ``self[i]``."""
        indices = [self._check_index(i) for i in indices]
        text = torch.from_numpy(self._text(indices))
        b, S = len(indices), self.seq_length
        return {
            "tokens": text[:, :-1].contiguous(),
            "labels": text[:, 1:].contiguous(),
            "loss_mask": torch.ones(b, S, dtype=torch.float32),
            "position_ids": torch.arange(S, dtype=torch.int64).expand(b, S).contiguous(),
        }

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[0] for key, value in self.batch([index]).items()}


@dataclass(frozen=True)
class MicroBatchSampler:
    """Samples DP rank ``dp_rank`` reads: each micro-step takes ``micro_batch_size x dp_size`` consecutive samples,
    rank ``r`` slice ``r`` (``MegatronPretrainingSampler``: same micro-batches whatever the DP size)."""

    micro_batch_size: int
    dp_rank: int
    dp_size: int
    num_microbatches: int

    def indices(self, consumed_samples: int, microbatch: int) -> range:
        """This rank's indices of 0-based ``microbatch`` of the step starting at ``consumed_samples``."""
        start = consumed_samples + (microbatch * self.dp_size + self.dp_rank) * self.micro_batch_size
        return range(start, start + self.micro_batch_size)


def collate(dataset, indices) -> dict[str, torch.Tensor]:
    """Stack samples ``indices`` (mod ``len(dataset)``) into :data:`SAMPLE_KEYS` ``[b, s]`` tensors."""
    n = len(dataset)
    if isinstance(dataset, SyntheticTokens):
        return dataset.batch(int(i) % n for i in indices)  # all samples generated at once
    samples = [dataset[int(i) % n] for i in indices]
    batch = {key: torch.stack([s[key] if torch.is_tensor(s[key]) else torch.as_tensor(np.asarray(s[key]))
                               for s in samples]) for key in SAMPLE_KEYS}
    return {key: v.float() if key == "loss_mask" else v.long() for key, v in batch.items()}


DEFAULT_SYNTHETIC_VOCAB = 512
#: Where ``data.source=mini-pile`` builds (or finds) the embedded corpus, relative to the working directory.
DEFAULT_MINI_PILE_DIR = "data/mini-pile"


@dataclass(frozen=True)
class RunData:
    """A run's datasets (``valid`` None: none), vocabulary size, tokenizer dir (None: synthetic), origin for
    ``config.json`` and similarity-batching info."""

    train: Any
    valid: Any
    vocab_size: int
    description: str
    tokenizer_dir: str | None = None
    similarity: dict[str, Any] | None = None


def _mini_pile(spec: str) -> tuple[list[str], str]:
    """Open (or build) ``mini-pile[:<dir>]`` on rank 0 first; ``(training prefixes, tokenizer dir)``. A built one
    is used as is (``python -m repro data`` rebuilds on source changes)."""
    from repro.data.minipile import open_mini_pile

    root = spec.partition(":")[2].strip() or DEFAULT_MINI_PILE_DIR
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        mini = open_mini_pile(root)
    barrier()
    if rank != 0:
        mini = open_mini_pile(root)
    return [str(mini.train_prefix)], str(Path(mini.vocab_path).parent)


def data_sources(config: RunConfig) -> tuple[list[str], str]:
    """``(prefixes, tokenizer dir)`` of a non-synthetic run (ReproError: synthetic, or no prefix)."""
    data = config.data
    if data.source == "synthetic":
        raise ReproError(f"experiment '{config.name}' trains on synthetic tokens: it has no tokenizer")
    kind, _, rest = data.source.partition(":")
    if kind == "mini-pile":
        return _mini_pile(data.source)
    prefixes = [p.strip() for p in rest.split(",") if p.strip()]
    if not prefixes:
        raise ReproError(f"data '{data.source}': give at least one indexed-dataset prefix after the colon")
    return prefixes, data.tokenizer or str(Path(prefixes[0]).parent)


def load_run_tokenizer(tokenizer_dir: str | os.PathLike):
    """Load the GPT-2-format tokenizer (``vocab.json`` + ``merges.txt``) in ``tokenizer_dir``."""
    from repro.data.tokenizer import load_tokenizer

    paths = [Path(tokenizer_dir) / name for name in ("vocab.json", "merges.txt")]
    for p in paths:
        if not p.is_file():
            raise ReproError(f"{p}: tokenizer file missing (set data.tokenizer=<dir with vocab.json and merges.txt>)")
    return load_tokenizer(*paths)


def tokenizer_fingerprint(tokenizer_dir: str | os.PathLike) -> str:
    """sha256 over ``vocab.json`` and ``merges.txt`` (what a checkpoint's evaluation must load again)."""
    import hashlib

    digest = hashlib.sha256()
    for name in ("vocab.json", "merges.txt"):
        digest.update((Path(tokenizer_dir) / name).read_bytes())
    return digest.hexdigest()


def build_run_data(config: RunConfig, seq_length: int, dp_size: int, cache_dir: str | os.PathLike) -> RunData:
    """Build the run's datasets (validation: ``validation.iters`` micro-batches per rank; cache in ``cache_dir``)."""
    data, validate = config.data, bool(config.validation.interval)
    valid_samples = max(1, config.validation.iters) * data.micro_batch_size * dp_size
    if data.source == "synthetic":
        vocab = data.vocab_size or DEFAULT_SYNTHETIC_VOCAB
        train = SyntheticTokens(vocab, seq_length, seed=config.seed, split=0, num_samples=data.synthetic_samples)
        valid = SyntheticTokens(vocab, seq_length, seed=config.seed, split=1, num_samples=valid_samples)
        note = "; similarity batching does not apply to synthetic tokens" if data.similarity_batching else ""
        return RunData(train, valid if validate else None, vocab, f"synthetic(vocab={vocab}){note}")

    prefixes, tokenizer_dir = data_sources(config)
    from repro.data.datasets import DEFAULT_SPLIT, build_datasets

    tokenizer = load_run_tokenizer(tokenizer_dir)
    split, similarity, origin = DEFAULT_SPLIT, None, f"indexed({', '.join(prefixes)})"
    if data.similarity_batching:
        from repro.data.similarity import build_similarity_dataset

        # Every rank calls it: one builds (or reuses the cached build), the others wait for it.
        sim = build_similarity_dataset(prefixes, split, eod=tokenizer.eod)
        prefixes, split = [sim.prefix], sim.split
        similarity = {"prefix": sim.prefix, "split": sim.split, "stats": sim.stats}
        origin = f"similarity-batched({origin})"
    samples = (config.schedule.steps * data.global_batch_size, valid_samples if validate else None, None)
    splits = build_datasets(prefixes, seq_length, samples, config.seed, cache_dir, tokenizer, split=split)
    if splits.train is None:
        raise ReproError(f"data.source '{data.source}': no training split was built")
    valid = splits.valid if validate else None
    return RunData(splits.train, valid, tokenizer.vocab_size, origin, str(Path(tokenizer_dir).resolve()), similarity)
