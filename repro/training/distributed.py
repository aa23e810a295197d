"""Process layout, the expert/non-expert parameter split and gradient-norm clipping for DP and EP runs.

megatron-core shards the experts over the expert-parallel (EP) ranks and marks every expert parameter with
``allreduce=False`` when EP > 1. Gradients must then be reduced in two different groups:

* non-expert parameters (``allreduce`` True or absent): summed over the data-parallel (DP) group;
* expert parameters (``allreduce=False``): summed over the *expert*-data-parallel group only (the ranks
  holding the same experts), never over the EP group (those ranks hold different experts).

Both are scaled by ``1 / dp_size``: an expert's gradient on its owning rank already sums the contributions
of every EP rank's tokens (through the all-to-all's backward), so it carries ``ep`` ranks' worth of the
per-rank-mean loss, exactly as a dense gradient does after the DP sum. This is megatron's own
``DistributedDataParallel`` rule (``gradient_scaling_factor = expert_gradient_scaling_factor = 1/dp``).

megatron's ``DistributedDataParallel`` does the reduction on CPU (gloo, with the CPU shims) and GPU alike
(:mod:`repro.training.optim`). This module provides the layout (:class:`Parallel`), the expert/non-expert
split of the parameters, and the global gradient norm and clipping the CPU path needs (megatron's
optimizer, which does them on GPU, allocates on CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Parallel:
    """This process's place in the run and the process groups the loop needs.

    Args:
        rank: global rank.
        world_size: number of processes.
        dp_rank: rank in the data-parallel group.
        dp_size: data-parallel size (includes the EP ranks: megatron carves EP out of DP).
        tp_size: tensor-parallel size.
        ep_rank: rank in the expert-parallel group.
        ep_size: expert-parallel size.
        expert_dp_size: size of the expert-data-parallel group (``dp_size / ep_size`` for TP=1).
        dp_group: the data-parallel group (None: single process).
        expert_dp_group: the expert-data-parallel group.
        ep_group: the expert-parallel group.
        tp_group: the tensor-parallel group.
    """

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    expert_dp_size: int = 1
    dp_group: object | None = field(default=None, compare=False, repr=False)
    expert_dp_group: object | None = field(default=None, compare=False, repr=False)
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
    """Read the layout and groups from megatron-core's ``parallel_state`` (initialised by the caller).

    Returns:
        The :class:`Parallel` of this process.
    """
    from megatron.core import parallel_state as ps

    if not (dist.is_available() and dist.is_initialized()):
        return Parallel()
    return Parallel(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        expert_dp_size=ps.get_expert_data_parallel_world_size(),
        dp_group=ps.get_data_parallel_group(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
        ep_group=ps.get_expert_model_parallel_group(),
        tp_group=ps.get_tensor_model_parallel_group(),
    )


def is_expert_param(name: str, param: torch.Tensor) -> bool:
    """Whether a parameter belongs to one expert (sharded over the EP ranks).

    megatron-core marks them ``allreduce=False``, but only when its TransformerConfig says
    ``expert_model_parallel_size > 1``; the name (``...mlp.experts...``) is checked too, so a config that
    leaves that field at 1 while ``parallel_state`` shards the experts cannot make the experts' gradients
    get averaged across ranks that hold different experts.
    """
    return (not getattr(param, "allreduce", True)) or ".experts." in f".{name}"


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(non-expert, expert)`` trainable parameters of ``model``, in module order."""
    dense, expert = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (expert if is_expert_param(name, p) else dense).append(p)
    return dense, expert


def _trainable(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def global_grad_norm(model: nn.Module, parallel: Parallel) -> torch.Tensor:
    """The L2 norm of the full model's gradient, as one process holding the whole model would see it.

    Non-expert parameters are replicated over DP (after the DDP reduction), so they are counted
    once; expert parameters differ across the EP group, so their squared norms are summed over it;
    tensor-parallel shards (``tensor_model_parallel`` attribute) are summed over the TP group and
    TP-duplicated parameters counted once.

    Args:
        model: the local model with reduced gradients.
        parallel: the layout and groups.

    Returns:
        A float32 scalar (float64 accumulation).
    """
    dense_sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)
    tp_rank = dist.get_rank(parallel.tp_group) if parallel.tp_size > 1 else 0
    dense, expert = split_params(model)
    for params, is_expert in ((dense, False), (expert, True)):
        for p in params:
            if p.grad is None:
                continue
            sharded_tp = bool(getattr(p, "tensor_model_parallel", False))
            if parallel.tp_size > 1 and not sharded_tp and tp_rank != 0:
                continue  # a TP duplicate: counted on TP rank 0 only
            sq = p.grad.detach().double().pow(2).sum().cpu()
            if is_expert:
                expert_sq += sq
            else:
                dense_sq += sq
    if parallel.ep_size > 1:
        expert_sq = expert_sq.to(_comm_device())
        dist.all_reduce(expert_sq, group=parallel.ep_group)
        expert_sq = expert_sq.cpu()
    total = dense_sq + expert_sq
    if parallel.tp_size > 1:
        total = total.to(_comm_device())
        dist.all_reduce(total, group=parallel.tp_group)
        total = total.cpu()
    return total.sqrt().float()


def clip_gradients(model: nn.Module, parallel: Parallel, max_norm: float) -> float:
    """Clip the global gradient norm to ``max_norm`` (torch's rule: scale by ``max_norm / (norm + 1e-6)``
    when that is below 1) and return the norm before clipping.

    Args:
        model: the local model with reduced gradients.
        parallel: the layout and groups.
        max_norm: the clip threshold (0 or less: measure only).

    Returns:
        The global gradient norm before clipping (``nan``/``inf`` passed through for the caller to see).
    """
    norm = float(global_grad_norm(model, parallel))
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in _trainable(model):
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm


def all_reduce_mean(values: torch.Tensor, group, group_size: int) -> torch.Tensor:
    """Mean of ``values`` over ``group`` (gloo has no AVG op: SUM then divide). Returns a new tensor."""
    out = values.detach().clone()
    if group_size > 1:
        out = out.to(_comm_device())
        dist.all_reduce(out, group=group)
        out = out / group_size
    return out.cpu()


def barrier() -> None:
    """A barrier over all processes (no-op without torch.distributed)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _comm_device() -> torch.device:
    # nccl only moves CUDA tensors; gloo moves CPU tensors.
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
