"""Baseline routers: Switch/dMoE, ReMoE, Expert Choice, Hash, Lory, SparseMixer-v2 (one file each).

Importing this package registers them (``@register_router``) under the names "switch", "remoe",
"expert_choice", "hash", "lory" and "sparsemixer".
"""

from baselines.expert_choice import ExpertChoiceConfig, ExpertChoiceRouter
from baselines.hash import HashConfig, HashRouter
from baselines.lory import LoryConfig, LoryRouter
from baselines.remoe import ReMoEConfig, ReMoERouter
from baselines.sparsemixer import SparseMixerConfig, SparseMixerRouter
from baselines.switch import SwitchConfig, SwitchRouter

__all__ = [
    "ExpertChoiceConfig",
    "ExpertChoiceRouter",
    "HashConfig",
    "HashRouter",
    "LoryConfig",
    "LoryRouter",
    "ReMoEConfig",
    "ReMoERouter",
    "SparseMixerConfig",
    "SparseMixerRouter",
    "SwitchConfig",
    "SwitchRouter",
]
