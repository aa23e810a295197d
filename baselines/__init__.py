"""Baseline routers: Switch/dMoE, ReMoE, Expert Choice, Hash, Lory, SparseMixer-v2, aux-loss-free balancing
(one file each).

Importing this package registers them (``@register_router``) under the names "switch", "remoe",
"expert_choice", "hash", "lory", "sparsemixer" and "auxfree".
"""

from baselines.auxfree import AuxFreeConfig, AuxFreeRouter
from baselines.expert_choice import ExpertChoiceConfig, ExpertChoiceRouter
from baselines.hash import HashConfig, HashRouter
from baselines.lory import LoryConfig, LoryRouter
from baselines.remoe import ReMoEConfig, ReMoERouter
from baselines.sparsemixer import SparseMixerConfig, SparseMixerRouter
from baselines.switch import SwitchConfig, SwitchRouter

__all__ = [
    "AuxFreeConfig", "AuxFreeRouter", "ExpertChoiceConfig", "ExpertChoiceRouter", "HashConfig", "HashRouter",
    "LoryConfig", "LoryRouter", "ReMoEConfig", "ReMoERouter", "SparseMixerConfig", "SparseMixerRouter",
    "SwitchConfig", "SwitchRouter",
]
