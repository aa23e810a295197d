"""Training datasets on megatron-core: ``GPTDataset`` through ``BlendedMegatronDatasetBuilder``.

:func:`build_datasets`: train/valid/test split by document (``"969,30,1"`` as in the papers); each sample holds::

    tokens        int64   [s]  input ids
    labels        int64   [s]  next-token ids (tokens shifted by one)
    loss_mask     float32 [s]  1.0 where the label counts in the loss
    position_ids  int64   [s]

Under ``torch.distributed`` call :func:`build_datasets` on every rank (``cache_dir`` shared).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import NamedTuple
from unittest import mock

import numpy as np
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from repro.data.indexed import existing_prefixes
from repro.data.tokenizer import Gpt2BpeTokenizer
from repro.errors import ReproError

DEFAULT_SPLIT = "969,30,1"


class DatasetSplits(NamedTuple):
    """The three splits (``None`` where a split has weight 0)."""

    train: GPTDataset | BlendedDataset | None
    valid: GPTDataset | BlendedDataset | None
    test: GPTDataset | BlendedDataset | None


def split_ranges(num_sequences: int, split: str) -> list[tuple[int, int] | None]:
    """megatron's train/valid/test ranges of n = ``num_sequences`` documents under ``split`` (e.g. ``"969,30,1"``):
    three ``(beg, end)`` pairs (None for a split without a share), as ``_build_megatron_dataset_splits``:
    ``beg = int(round(split[i][0] * n))``, ``end = int(round(split[i][1] * n))``."""
    # An all-zero split divides by zero before megatron refuses it: no RuntimeWarning before the caller's error.
    with np.errstate(divide="ignore", invalid="ignore"):
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    n = float(num_sequences)
    return [None if b is None else (int(round(b[0] * n)), int(round(b[1] * n))) for b in matrix]


def build_datasets(prefixes: Sequence[str | os.PathLike], seq_length: int,
                   num_samples: tuple[int | None, int | None, int | None], seed: int, cache_dir: str | os.PathLike,
                   tokenizer: Gpt2BpeTokenizer, *, split: str = DEFAULT_SPLIT) -> DatasetSplits:
    """Build megatron-core's GPT train/valid/test datasets over a blend of indexed datasets, weighted by their
    token counts if every split with a share has a sample count, else one epoch each.

    Args:
        prefixes: indexed-dataset prefixes (from :mod:`repro.data.indexed`).
        seq_length: tokens per sample.
        num_samples: ``(train, valid, test)`` samples; ``None`` = one epoch (more repeats in reshuffled epochs).
        seed: megatron's document and sample shuffle seed.
        cache_dir: megatron's shuffle/sample index cache (shared by all ranks).
        tokenizer: megatron reads ``eod`` and ``vocab_size``; its identity keys the cache.
        split: megatron's ``split`` of each prefix's documents.

    Returns:
        :class:`DatasetSplits`; ReproError for a missing prefix or a split leaving some prefix's part empty.
    """
    prefixes = existing_prefixes(prefixes)
    if len(num_samples) != 3:
        raise ReproError(f"num_samples must give (train, valid, test), got {tuple(num_samples)}")
    num_tokens = []
    for prefix in prefixes:  # a part without documents would make megatron loop forever
        ds = IndexedDataset(prefix)  # referenced while read: its __del__ closes the mmap under any live view
        n = len(ds)
        num_tokens.append(float(np.sum(ds.sequence_lengths, dtype=np.int64)))
        ranges = split_ranges(n, split)  # which parts have a share is the same for every prefix
        for name, bounds in zip(("train", "valid", "test"), ranges):
            if bounds is not None and bounds[1] <= bounds[0]:
                raise ReproError(f"{prefix}: split '{split}' leaves the {name} split no document out of {n}; "
                                 "use a larger corpus or a split with a larger share for it")
    # a split with no share builds nothing: give it 0 samples so megatron's weights/sizes check passes
    sizes = [0 if bounds is None and n is None else n for bounds, n in zip(ranges, num_samples)]
    weights = num_tokens if len(prefixes) > 1 and None not in sizes else None
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=(prefixes, weights), split=split,
                              path_to_cache=str(cache_dir), tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
                              mmap_bin_files=True)
    # Every rank builds: each data-parallel rank reads its own slice of the samples.
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)
    # megatron-core 0.16.1's BlendedDataset._build_indices calls get_rank() unguarded on a cache miss: 0 outside a group
    dist = torch.distributed
    outside = dist.is_available() and not dist.is_initialized()
    with mock.patch.object(dist, "get_rank", lambda group=None: 0) if outside else contextlib.nullcontext():
        return DatasetSplits(*builder.build())

