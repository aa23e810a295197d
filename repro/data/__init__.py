"""Data: Pile reader, GPT-2 BPE tokenizer, megatron-core indexed datasets, the embedded mini-pile, similarity
batching, token counts and ``python -m repro data`` (the modules: docs/development.md, "Layout").

Importing this package imports none of its modules (megatron-core is imported only by what needs it, its
CPU notices quiet: :func:`routers.registry.quiet_megatron_import`).
"""
