"""Data: The Pile, GPT-2 BPE, indexed datasets, the mini-pile, similarity batching, token counts (the modules:
docs/development.md, "Layout"); importing the package imports none of them."""
