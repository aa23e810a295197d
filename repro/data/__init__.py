"""Data: The Pile, GPT-2 BPE, indexed datasets, the mini-pile, similarity batching, token counts (the modules:
docs/development.md, "Layout"). Importing it imports no module (megatron-core only where needed, via
:func:`routers.registry.quiet_megatron_import`).
"""
