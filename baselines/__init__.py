"""Baseline routers, one file each; importing this package registers them (``@register_router``): Switch/dMoE
"switch", "remoe", "expert_choice", "hash", "lory", SparseMixer-v2 "sparsemixer" and aux-loss-free "auxfree"."""

from baselines import auxfree, expert_choice, hash, lory, remoe, sparsemixer, switch  # noqa: F401 (registers them)
