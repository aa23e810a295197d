"""Token counts of a corpus's training documents: what Hash's ``balanced`` table is built from.

Hash Layers (Roller et al. 2021) balance by unigram frequency; only the *training* split counts (valid/test
must not shape the table). Cached as ``<first prefix>.tokcounts-<key>.npy`` for option ``counts_path``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

from repro.data.datasets import DEFAULT_SPLIT, split_ranges
from repro.data.indexed import dataset_fingerprint, existing_prefixes
from repro.errors import ReproError
from repro.io_utils import atomic_path


def count_tokens(prefixes: Sequence[str | os.PathLike], split: str = DEFAULT_SPLIT, vocab_size: int | None = None) -> np.ndarray:
    """``[V]`` int64 per-id token counts over the training documents of indexed datasets.

    Args:
        split: megatron's split; only each prefix's training range is counted.
        vocab_size: result length (ReproError for a larger id); default: largest id + 1.
    """
    total = np.zeros(0 if vocab_size is None else vocab_size, dtype=np.int64)
    for prefix in existing_prefixes(prefixes, "token counts: ") if prefixes else []:
        ds = IndexedDataset(prefix)
        bounds = split_ranges(len(ds), split)[0]
        if bounds is None or bounds[1] <= bounds[0]:
            continue
        beg, end = bounds
        # The training range is contiguous in the data file: one read, counted in blocks of 16M tokens.
        offset = int(ds.index.sequence_pointers[beg])
        itemsize = np.dtype(ds.index.dtype).itemsize
        remaining = int(ds.sequence_lengths[beg:end].astype(np.int64).sum())
        while remaining:
            n = min(remaining, 1 << 24)
            block = ds.bin_reader.read(dtype=ds.index.dtype, count=n, offset=offset).astype(np.int64)
            if vocab_size is not None and block.size and int(block.max()) >= vocab_size:
                raise ReproError(f"{prefix}: token id {int(block.max())} >= vocab_size {vocab_size}")
            counts = np.bincount(block, minlength=total.size)
            total = np.pad(total, (0, counts.size - total.size)) + counts
            offset += n * itemsize
            remaining -= n
        del ds
    return total


def token_counts_file(prefixes: Sequence[str | os.PathLike], split: str = DEFAULT_SPLIT,
                      vocab_size: int | None = None) -> str:
    """Write (or reuse) :func:`count_tokens`'s ``.npy`` beside the first prefix; never overwrites other files."""
    sources = existing_prefixes(prefixes, "token counts: ")
    inputs = {"sources": [dataset_fingerprint(p) for p in sources], "split": split, "vocab_size": vocab_size}
    path = f"{sources[0]}.tokcounts-{hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]}.npy"
    if os.path.exists(path):
        try:
            existing = np.load(path, allow_pickle=False)
        except (OSError, ValueError):
            existing = None
        if existing is None or existing.ndim != 1 or existing.dtype != np.int64:
            raise ReproError(f"{path}: exists but is not a token-counts array; move it away (it is not overwritten)")
        return path
    counts = count_tokens(sources, split, vocab_size)
    with atomic_path(path) as tmp:
        np.save(tmp, counts)  # tmp ends with .npy: np.save adds no suffix
    return path
