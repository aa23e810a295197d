"""Training datasets on megatron-core: ``GPTDataset`` through ``BlendedMegatronDatasetBuilder``.

:func:`build_datasets`: train/valid/test split by document (``"969,30,1"`` as in the papers); each sample holds::

    tokens        int64   [s]  input ids
    labels        int64   [s]  next-token ids (tokens shifted by one)
    loss_mask     float32 [s]  1.0 where the label counts in the loss
    position_ids  int64   [s]
    attention_mask bool   [1, s, s]  only with ``create_attention_mask=True`` (True = masked)

Under ``torch.distributed`` call :func:`build_datasets` on every rank (``cache_dir`` shared).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

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
    """The three splits (``None`` where a split has weight 0 or is not built on this rank)."""

    train: GPTDataset | BlendedDataset | None
    valid: GPTDataset | BlendedDataset | None
    test: GPTDataset | BlendedDataset | None


def _num_tokens(prefix: str) -> int:
    # Keep the dataset referenced while reading: its __del__ closes the mmap under any live view.
    ds = IndexedDataset(prefix)
    n = int(np.sum(ds.sequence_lengths, dtype=np.int64))
    del ds
    return n


def split_ranges(num_sequences: int, split: str) -> list[tuple[int, int] | None]:
    """megatron's train/valid/test ranges of one dataset, as ``_build_megatron_dataset_splits``:
    ``beg = int(round(split[i][0] * n))``, ``end = int(round(split[i][1] * n))``.

    Args:
        num_sequences: n, documents in the dataset.
        split: megatron's split string, e.g. ``"969,30,1"``.

    Returns:
        Three ``(beg, end)`` pairs, None for a split without a share.
    """
    # An all-zero split divides by zero before megatron refuses it: no RuntimeWarning before the caller's error.
    with np.errstate(divide="ignore", invalid="ignore"):
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    n = float(num_sequences)
    return [None if b is None else (int(round(b[0] * n)), int(round(b[1] * n))) for b in matrix]


def _check_splits(prefixes: Sequence[str], split: str) -> list[tuple[int, int] | None]:
    """Refuse a split leaving some prefix's part empty (megatron would loop forever); returns the last
    prefix's :func:`split_ranges` (which parts have a share is the same for every prefix)."""
    for prefix in prefixes:
        n = len(IndexedDataset(prefix))
        ranges = split_ranges(n, split)
        for name, bounds in zip(("train", "valid", "test"), ranges):
            if bounds is not None and bounds[1] <= bounds[0]:
                raise ReproError(
                    f"{prefix}: split '{split}' leaves the {name} split no document out of {n}; "
                    "use a larger corpus or a split with a larger share for it"
                )
    return ranges


def build_datasets(
    prefixes: Sequence[str | os.PathLike], seq_length: int, num_samples: tuple[int | None, int | None, int | None],
    seed: int, cache_dir: str | os.PathLike, tokenizer: Gpt2BpeTokenizer, *, weights: Sequence[float] | None = None,
    split: str = DEFAULT_SPLIT, eod_mask_loss: bool = False, reset_position_ids: bool = False,
    reset_attention_mask: bool = False, create_attention_mask: bool = False,
    is_built_on_rank: Callable[[], bool] | None = None,
) -> DatasetSplits:
    """Build megatron-core's GPT train/valid/test datasets over a blend of indexed datasets.

    Args:
        prefixes: indexed-dataset prefixes (from :mod:`repro.data.indexed`).
        seq_length: tokens per sample.
        num_samples: ``(train, valid, test)`` samples; ``None`` = one epoch (more repeats in reshuffled epochs).
        seed: megatron's document and sample shuffle seed.
        cache_dir: megatron's shuffle/sample index cache (shared by all ranks).
        tokenizer: megatron reads ``eod`` and ``vocab_size``; its identity keys the cache.
        weights: one per prefix; default: token counts if every shared split has a count, else one epoch each.
        split: megatron's ``split`` of each prefix's documents.
        eod_mask_loss: mask the loss on EOD tokens.
        reset_position_ids: restart position ids after each EOD.
        reset_attention_mask: block attention across documents (implies a per-sample attention mask).
        create_attention_mask: return megatron's causal ``attention_mask`` with each sample.
        is_built_on_rank: megatron's per-rank switch, under ``torch.distributed`` only (default: every rank).

    Returns:
        :class:`DatasetSplits`; ReproError for a missing prefix or a split leaving some prefix's part empty.
    """
    prefixes = existing_prefixes(prefixes)
    if weights is not None and len(weights) != len(prefixes):
        raise ReproError(f"{len(weights)} blend weights for {len(prefixes)} datasets")
    if len(num_samples) != 3:
        raise ReproError(f"num_samples must give (train, valid, test), got {tuple(num_samples)}")
    ranges = _check_splits(prefixes, split)
    # a split with no share builds nothing: give it 0 samples so megatron's weights/sizes check passes
    sizes = [0 if bounds is None and n is None else n for bounds, n in zip(ranges, num_samples)]
    if weights is not None and None in sizes:
        raise ReproError("blend weights need a sample count for every split that has a share")
    if weights is None and len(prefixes) > 1 and None not in sizes:
        weights = [float(_num_tokens(p)) for p in prefixes]
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(prefixes, list(weights) if weights is not None else None),
        split=split, path_to_cache=str(cache_dir), tokenizer=tokenizer, reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask, eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask or reset_attention_mask, mmap_bin_files=True,
    )
    # Every rank builds by default: each data-parallel rank reads its own slice of the samples.
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, is_built_on_rank or (lambda: True), config)
    with _rank_zero_outside_distributed():
        return DatasetSplits(*builder.build())


@contextlib.contextmanager
def _rank_zero_outside_distributed() -> Iterator[None]:
    """``torch.distributed.get_rank()`` returns 0 in the block when no group exists: megatron-core 0.16.1's
    ``BlendedDataset._build_indices`` calls it on a cache miss without checking ``is_initialized()``."""
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        yield
        return
    original = dist.get_rank
    dist.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        dist.get_rank = original


def sample_token_documents(dataset: GPTDataset | BlendedDataset, idx: int) -> tuple[str, np.ndarray, np.ndarray]:
    """Source of every input token of sample ``idx`` (shuffle index -> sample index -> document index).

    Returns:
        ``(prefix, doc [S], offset [S])`` (-1: padding), ``IndexedDataset(prefix)[doc[i]][offset[i]] == tokens[i]``.
    """
    if isinstance(dataset, BlendedDataset):
        sub = dataset.datasets[int(dataset.dataset_index[idx])]
        return sample_token_documents(sub, int(dataset.dataset_sample_index[idx]))
    cfg = dataset.config
    extra = int(cfg.add_extra_token_to_sequence)
    j = int(dataset.shuffle_index[idx])
    beg, beg_off = (int(v) for v in dataset.sample_index[j])
    end, end_off = (int(v) for v in dataset.sample_index[j + 1])
    lengths = dataset.dataset.sequence_lengths
    docs, offsets = [], []
    for k in range(beg, end + 1):
        doc = int(dataset.document_index[k])
        start = beg_off if k == beg else 0
        stop = int(lengths[doc]) if k < end else end_off + extra
        docs.append(np.full(stop - start, doc, dtype=np.int64))
        offsets.append(np.arange(start, stop, dtype=np.int64))
    doc_ids, offs = np.concatenate(docs), np.concatenate(offsets)
    total = cfg.sequence_length + extra
    if doc_ids.size < total:  # megatron pads a short last sample
        pad = np.full(total - doc_ids.size, -1, dtype=np.int64)
        doc_ids, offs = np.concatenate([doc_ids, pad]), np.concatenate([offs, pad])
    return dataset.dataset_path, doc_ids[: cfg.sequence_length], offs[: cfg.sequence_length]

