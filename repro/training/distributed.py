"""Process layout, the expert/non-expert parameter split and the global gradient-norm clipping of the CPU
path (megatron's optimizer, which clips on GPU, allocates on CUDA).

megatron's DDP reduces gradients (:mod:`repro.training.optim`): non-expert parameters over DP, expert ones
(``allreduce=False``) over expert-DP only, both scaled by ``1 / dp_size``: an expert's gradient already sums
every EP rank's tokens through the all-to-all's backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Parallel:
    """This process's ranks and groups (None: one process); ``dp_size`` includes EP (megatron carves EP out of DP)."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    dp_group: object | None = field(default=None, compare=False, repr=False)
    ep_group: object | None = field(default=None, compare=False, repr=False)
    tp_group: object | None = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        """Whether this is global rank 0 (the one that writes logs and summaries)."""
        return self.rank == 0

    def layout(self) -> dict[str, int]:
        """The sizes, for config records and checkpoint compatibility checks."""
        return {"world_size": self.world_size, "dp": self.dp_size, "tp": self.tp_size, "ep": self.ep_size}


def current_parallel() -> Parallel:
    """This process's :class:`Parallel`, from megatron-core's ``parallel_state`` (initialised by the caller)."""
    from megatron.core import parallel_state as ps

    if not (dist.is_available() and dist.is_initialized()):
        return Parallel()
    return Parallel(
        rank=dist.get_rank(), world_size=dist.get_world_size(), dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(), tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        dp_group=ps.get_data_parallel_group(), ep_group=ps.get_expert_model_parallel_group(),
        tp_group=ps.get_tensor_model_parallel_group(),
    )


def is_expert_param(name: str, param: torch.Tensor) -> bool:
    """``allreduce=False`` (set by megatron only with EP > 1) or named ``...experts...``."""
    return (not getattr(param, "allreduce", True)) or ".experts." in f".{name}"


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(non-expert, expert)`` trainable parameters of ``model``, in module order."""
    dense, expert = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (expert if is_expert_param(name, p) else dense).append(p)
    return dense, expert


def clip_gradients(model: nn.Module, parallel: Parallel, max_norm: float) -> float:
    """Clip to ``max_norm`` (<= 0: measure only) by torch's rule, ``* max_norm / (norm + 1e-6)`` if below 1; return
    the pre-clip norm (nan/inf too): the whole model's (experts over EP, TP shards over TP, duplicates once; fp64)."""
    tp_rank = dist.get_rank(parallel.tp_group) if parallel.tp_size > 1 else 0

    def squares(params: list[nn.Parameter]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for p in params:
            if p.grad is None:
                continue
            sharded_tp = bool(getattr(p, "tensor_model_parallel", False))
            if parallel.tp_size > 1 and not sharded_tp and tp_rank != 0:
                continue  # a TP duplicate: counted on TP rank 0 only
            # In-place square of a float64 copy: ``.double().pow(2).sum()`` with one allocation fewer.
            sq = p.grad.detach().to(torch.float64, copy=True)
            total += sq.mul_(sq).sum().cpu()
        return total

    dense, expert = split_params(model)
    dense_sq, expert_sq = squares(dense), squares(expert)
    if parallel.ep_size > 1:
        expert_sq = all_reduce(expert_sq, parallel.ep_group).cpu()
    total = dense_sq + expert_sq
    if parallel.tp_size > 1:
        total = all_reduce(total, parallel.tp_group).cpu()
    norm = float(total.sqrt().float())
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in (*dense, *expert):
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm


def all_reduce_mean(values: torch.Tensor, group, group_size: int) -> torch.Tensor:
    """Mean of ``values`` over ``group`` (gloo has no AVG op: SUM then divide). Returns a new tensor."""
    out = values.detach().clone()
    return (all_reduce(out, group) / group_size if group_size > 1 else out).cpu()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce(values: torch.Tensor, group=None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """``values`` reduced with ``op`` over ``group`` (None: all); in place if already on nccl's CUDA or gloo's CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        values = values.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(values, op=op, group=group)
    return values
