"""Driving the routers' step schedules from a training loop.

The loop calls :func:`begin_step` before a step's forward passes (with whether the routers compute their
diagnostic metrics in this step) and :func:`end_step` after the optimizer step. ``end_step`` averages each
router class's :meth:`Router.step_statistic` over its layers and over the data-parallel ranks, then hands the
average to every router of that class, so layer replicas of a global schedule (ReMoE's L1 coefficient) stay
identical on every rank. A statistic with one value per expert (the aux-loss-free router's token counts) is
per layer instead: summed over the ranks and handed back to its own layer's router.
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
    """Set the global ``step`` (completed optimizer steps) on every router of ``model`` (schedules read it in
    the forward), and whether they compute their diagnostic metrics in this step's forwards
    (:attr:`routers.base.Router.collect_metrics`; training is identical either way)."""
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
    """Average the routers' step statistics over layers and the data-parallel ``group`` (``None``: no
    averaging over ranks) and apply their schedule updates.

    Nothing here reads a device value: the averages stay tensors (an all-reduce, no ``.item()``), so a step
    that does not log forces no host synchronisation; the caller converts them when it logs.

    Returns:
        ``{router_name: averaged statistic}`` (float32 scalar tensors on the routers' device) for the router
        classes that report one (for logging).
    """
    by_class: dict[type, list[Router]] = defaultdict(list)
    for router in routers_in(model):
        by_class[type(router)].append(router)
    averaged: dict[str, torch.Tensor] = {}
    for cls, routers in by_class.items():
        stats = [r.step_statistic() for r in routers]
        if all(s is None for s in stats):
            for r in routers:
                r.end_step(None)
            continue
        if any(s is not None and s.dim() > 0 for s in stats):
            _end_step_per_layer(routers, stats, group)
            continue
        mean = torch.stack([s.detach().float() for s in stats if s is not None]).mean()
        if _all_reduce(mean, group):
            mean = mean / dist.get_world_size(group)
        for r in routers:
            r.end_step(mean)
        averaged[cls.name] = mean.detach()
    return averaged


def _end_step_per_layer(routers: list[Router], stats: list[torch.Tensor | None], group: dist.ProcessGroup | None) -> None:
    """A per-expert statistic (``[E]``, the aux-loss-free router's token counts) belongs to its own layer: it is
    summed over the data-parallel ranks, all layers in one all-reduce, and handed back to its router."""
    ref = next(s for s in stats if s is not None)
    stacked_LE = torch.stack([(s if s is not None else torch.zeros_like(ref)).detach().float() for s in stats])
    _all_reduce(stacked_LE, group)
    for router, row_E in zip(routers, stacked_LE):
        router.end_step(row_E)
