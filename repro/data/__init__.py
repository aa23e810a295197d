"""Data: Pile reader, GPT-2 BPE tokenizer, megatron-core indexed datasets, the embedded mini-pile, similarity
batching, token counts and ``python -m repro data`` (the modules: docs/development.md, "Layout").

Importing it imports no module (megatron-core only where needed, via :func:`routers.registry.quiet_megatron_import`).
"""
