"""Data: Pile reader, GPT-2 BPE tokenizer, megatron-core indexed datasets, the embedded mini-pile, loaders.

Modules:
    pile       stream Pile-format shards (``*.jsonl.zst`` / ``*.jsonl``) as ``(text, domain)``; write shards
    tokenizer  GPT-2 byte-level BPE from vocab.json + merges.txt (megatron-compatible); train one; encode in parallel
    indexed    shards -> ``PREFIX.bin/.idx`` with a per-document domain sidecar (imports megatron-core)
    datasets   megatron ``GPTDataset`` train/valid/test via ``BlendedMegatronDatasetBuilder``; batch loader;
               token -> document -> domain mapping (imports megatron-core and torch)
    minipile   the embedded multi-domain corpus built from text on the machine (``build_mini_pile``);
               its per-domain source readers in ``minipile_sources``
    similarity Lory's similarity-based batching: a derived dataset of chains of similar documents
    token_counts  training-token counts per id (Hash's ``balanced`` table)
    cli        ``python -m repro data mini-pile|tokenize|token-counts``

Importing this package imports none of them (megatron-core is imported only by what needs it).
"""
