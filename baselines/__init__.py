"""Baseline routers: Switch/dMoE, ReMoE, Expert Choice, Hash, Lory, SparseMixer-v2, aux-loss-free balancing
(one file each).

Importing this package registers them (``@register_router``) under the names "switch", "remoe",
"expert_choice", "hash", "lory", "sparsemixer" and "auxfree".
"""

from baselines import auxfree, expert_choice, hash, lory, remoe, sparsemixer, switch  # noqa: F401 (registers them)
