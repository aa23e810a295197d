"""Data: Pile reader, GPT-2 BPE tokenizer, megatron-core indexed datasets, the embedded mini-pile, loaders.

Modules:
    pile       stream Pile-format shards (``*.jsonl.zst`` / ``*.jsonl``) as ``(text, domain)``; write shards
    tokenizer  GPT-2 byte-level BPE from vocab.json + merges.txt (megatron-compatible); train one; encode in parallel
    indexed    shards -> ``PREFIX.bin/.idx`` with a per-document domain sidecar (imports megatron-core)
    datasets   megatron ``GPTDataset`` train/valid/test via ``BlendedMegatronDatasetBuilder``; batch loader;
               token -> document -> domain mapping (imports megatron-core and torch)
    minipile   the embedded multi-domain corpus built from text on the machine (``build_mini_pile``);
               its per-domain source readers in ``minipile_sources``
    similarity Lory's similarity-based batching: a derived dataset of chains of similar documents; the
               document vectors, neighbour search and chains in ``similarity_chains``
    token_counts  training-token counts per id (Hash's ``balanced`` table)
    cli        ``python -m repro data mini-pile|tokenize|token-counts``

The names below are importable from ``repro.data`` directly; each loads its module on first use, so
``import repro.data`` stays cheap (megatron-core is imported only by what needs it).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PileRecord": "pile",
    "iter_pile_documents": "pile",
    "write_pile_shard": "pile",
    "EOD_TOKEN": "tokenizer",
    "Gpt2BpeTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_bpe_tokenizer": "tokenizer",
    "encode_documents": "tokenizer",
    "TokenizeStats": "indexed",
    "tokenize_shards": "indexed",
    "write_indexed": "indexed",
    "load_domain_index": "indexed",
    "DomainIndex": "indexed",
    "read_documents": "indexed",
    "indexed_exists": "indexed",
    "DatasetSplits": "datasets",
    "build_datasets": "datasets",
    "make_loader": "datasets",
    "sample_token_documents": "datasets",
    "DomainTaggedDataset": "datasets",
    "PretrainingBatchSampler": "datasets",
    "MiniPile": "minipile",
    "MiniPileConfig": "minipile",
    "DomainStats": "minipile",
    "build_mini_pile": "minipile",
    "iter_heldout": "minipile",
    "SimilarityBatchingConfig": "similarity",
    "SimilarityBatched": "similarity",
    "build_similarity_dataset": "similarity",
    "count_tokens": "token_counts",
    "token_counts_file": "token_counts",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
