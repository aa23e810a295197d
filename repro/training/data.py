"""The training and validation samples of an experiment: the synthetic source or megatron indexed datasets,
both indexable, so that a run's data position is one integer (the consumed-sample count) and a resumed run
reads the samples an uninterrupted one would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from repro.config import RunConfig
from repro.errors import ReproError
from repro.training.distributed import barrier
from repro.training.synthetic import SyntheticTokens

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
