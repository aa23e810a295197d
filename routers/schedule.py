"""Driving the routers' step schedules from a training loop: :func:`begin_step` before a step's forwards,
:func:`end_step` after the optimizer step. The latter averages each router class's :meth:`Router.step_statistic`
over layers and data-parallel ranks and hands it to every router of the class, so a global schedule (ReMoE's L1
coefficient) stays identical everywhere; a per-expert statistic (aux-free counts) is summed over ranks per layer.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from routers.base import Router


def routers_in(model: nn.Module) -> list[Router]:
    """All :class:`Router` modules inside ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, Router)]


def begin_step(model: nn.Module, step: int, collect_metrics: bool = True) -> None:
    """Set ``step`` (completed optimizer steps) and :attr:`~routers.base.Router.collect_metrics` on every router."""
    for router in routers_in(model):
        router.set_step(step)
        router.collect_metrics = bool(collect_metrics)


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Sum ``tensor`` in place over ``group``; False (nothing done) without a group or torch.distributed."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return False
    dist.all_reduce(tensor, group=group)
    return True


def end_step(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """Average the routers' step statistics over layers and the data-parallel ``group`` (None: this rank only) and
    apply their schedule updates, reading no device value (no host sync).

    Returns:
        ``{router_name: averaged statistic}`` (float32 device scalars) for the classes that report one.
    """
    by_class: dict[type, list[Router]] = defaultdict(list)
    for router in routers_in(model):
        by_class[type(router)].append(router)
    averaged: dict[str, torch.Tensor] = {}
    for cls, routers in by_class.items():
        stats = [r.step_statistic() for r in routers]
        present = [s for s in stats if s is not None]
        if not present:
            for r in routers:
                r.end_step(None)
        elif any(s.dim() > 0 for s in present):
            # Per-expert [E] statistics: summed over ranks (all layers in one all-reduce), each back to its router.
            stacked_LE = torch.stack([(torch.zeros_like(present[0]) if s is None else s).detach().float()
                                      for s in stats])
            _all_reduce(stacked_LE, group)
            for r, row_E in zip(routers, stacked_LE):
                r.end_step(row_E)
        else:
            mean = torch.stack([s.detach().float() for s in present]).mean()
            if _all_reduce(mean, group):
                mean = mean / dist.get_world_size(group)
            for r in routers:
                r.end_step(mean)
            averaged[cls.name] = mean.detach()
    return averaged

