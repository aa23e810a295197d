"""A deterministic synthetic token source with learnable structure, and the micro-batch sampler.

Stands in for a corpus in tests and smoke runs: indexable like ``GPTDataset``, each sample a pure function of
``(seed, split, i)``, its text a sparse bigram chain with noise, so the loss falls within a few steps.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

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

    def __post_init__(self) -> None:
        if self.vocab_size < 2 or self.seq_length < 1:
            raise ValueError(f"need vocab_size >= 2 and seq_length >= 1, got {self.vocab_size}, {self.seq_length}")

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
    batch = {}
    for key in SAMPLE_KEYS:
        values = [torch.as_tensor(np.asarray(s[key])) if not torch.is_tensor(s[key]) else s[key] for s in samples]
        stacked = torch.stack(values)
        batch[key] = stacked.float() if key == "loss_mask" else stacked.long()
    return batch
