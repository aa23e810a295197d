"""The optimizer side of a training step, behind one small interface for CPU and GPU: both wrap the model in
megatron-core's ``DistributedDataParallel`` (:mod:`repro.training.distributed`); the CPU path steps torch's
AdamW (megatron's optimizer allocates on CUDA), the GPU path megatron's. Weight decay follows megatron: none
on biases and 1-D parameters (norm weights, router biases).

The LR schedule is the papers': linear warmup then cosine decay to a floor (megatron's ``cosine`` style). After
``step`` completed steps the next uses ``lr_at(step + 1)``: the first trains at ``lr / warmup_steps`` (not a
wasted 0), the last warmup step at the peak, the last step at ``min_lr``, as megatron counts
(``OptimizerParamScheduler.step`` increments first).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from repro.training.distributed import Parallel, clip_gradients, is_expert_param


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decayed (>= 2-D) then not (biases, 1-D), empty ones dropped (fixed order: state loads back)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _wrap_ddp(model: nn.Module, parallel: Parallel, distributed_optimizer: bool) -> nn.Module:
    """megatron-core's DDP around ``model`` (fp32 grad buffers, no overlap). With EP > 1 expert parameters get
    ``allreduce=False`` first: DDP splits by it, but megatron's layers set it only when their config has EP > 1."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if parallel.ep_size > 1:
        for name, p in model.named_parameters():
            if is_expert_param(name, p):
                p.allreduce = False
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def foreach_multi_tensor_l2_norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], per_tensor: bool,
    *args: Any,
) -> tuple[torch.Tensor, None]:
    """Sync-free drop-in for megatron's TE/Apex-free ``local_multi_tensor_l2_norm`` (a host sync per tensor):
    ``torch._foreach_norm`` accumulating in fp32 as ``amp_C`` does; differs from it by reduction order only.

    Args:
        chunk_size, noop_flag: ``multi_tensor_applier``'s arguments, unused (as by the fallback).
        tensor_lists: tensors on one device; the norm is over all of them.
        per_tensor: unused (the fallback returns no per-tensor norms either).

    Returns:
        ``(global L2 norm as float32 [1] on the tensors' device, None)``.
    """
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_multi_tensor_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], scale: float
) -> None:
    """Bit-identical multi-tensor drop-in for megatron's ``local_multi_tensor_scale`` (two launches per tensor).

    Args:
        chunk_size, noop_flag: ``multi_tensor_applier``'s arguments, unused (as by the fallback).
        tensor_lists: ``[sources, destinations]``; same list twice: in place (clipping); scale 1.0: a copy.
        scale: the factor.
    """
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if not dst:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        # x * 1.0 is x exactly: only the cast to the destination's dtype remains, which the copy makes.
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


@contextlib.contextmanager
def foreach_optimizer_fallbacks(enabled: bool = True) -> Iterator[list[str]]:
    """In the block megatron's optimizer uses the ``foreach_*`` drop-ins above instead of its TE/Apex-free
    fallbacks (TE/Apex kernels stay). Names are read at call time, so the block must span ``step()``.

    Args:
        enabled: False makes the block a no-op.

    Yields:
        The ``module.name`` attributes replaced.
    """
    import importlib

    mcore_utils = importlib.import_module("megatron.core.utils")
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    mcore_optimizer = importlib.import_module("megatron.core.optimizer.optimizer")

    replacements = {
        mcore_utils.local_multi_tensor_l2_norm: foreach_multi_tensor_l2_norm,
        mcore_utils.local_multi_tensor_scale: foreach_multi_tensor_scale,
    }
    targets = [(clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
               (mcore_optimizer, "multi_tensor_scale_impl")]
    saved = []
    try:
        if enabled:
            for module, name in targets:
                current = getattr(module, name, None)
                if current in replacements:
                    saved.append((module, name, current))
                    setattr(module, name, replacements[current])
        yield [f"{module.__name__}.{name}" for module, name, _ in saved]
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


class _Optimization:
    """Shared by both paths: ``ddp_model`` (run forward/backward through it) and ``param_groups`` (LR written there)."""

    ddp_model: nn.Module
    optimizer: Any

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Zero megatron's grad buffers and drop the optimizer's gradients before a step's first backward."""
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)  # megatron's optimizers default to set_to_none=True too

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def release(self) -> None:
        release_ddp(self.ddp_model)


def release_ddp(ddp_model: nn.Module) -> None:
    """Free a DDP-wrapped model after training: DDP's accumulator hooks close over it and the alltoall dispatcher's
    kept probs reach them, a C++ cycle the GC cannot see. Emptying the wrapper (then unusable) breaks it."""
    ddp_model.__dict__.clear()


class CpuOptimization(_Optimization):
    """megatron DDP reduction (gloo, fp32 ``main_grad``), :func:`clip_gradients`, torch's AdamW."""

    def __init__(
        self, model: nn.Module, parallel: Parallel, *, lr: float, weight_decay: float, betas: tuple[float, float],
        eps: float, clip_grad: float,
    ) -> None:
        self.model, self.parallel, self.clip_grad = model, parallel, clip_grad
        self.ddp_model = _wrap_ddp(model, parallel, distributed_optimizer=False)
        # fused: one pass per parameter; elementwise, so deterministic and identical whatever the layout.
        self.optimizer = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=True)

    def step(self) -> float:
        """Reduce gradients over the ranks, clip, and update; return the global gradient norm before clipping."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp_model])
        for p in self.model.parameters():
            if p.requires_grad:
                # The reduced gradient lives in megatron's buffer; AdamW reads .grad (same storage, fp32).
                p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
        grad_norm = clip_gradients(self.model, self.parallel, self.clip_grad)
        self.optimizer.step()
        return grad_norm


class MegatronOptimization(_Optimization):  # pragma: no cover - needs CUDA
    """megatron-core's DDP and optimizer (GPU only; fp32 main params; ``distributed_optimizer`` shards state)."""

    def __init__(
        self, model: nn.Module, parallel: Parallel, *, lr: float, weight_decay: float, betas: tuple[float, float],
        eps: float, clip_grad: float, bf16: bool, distributed_optimizer: bool, foreach_fallbacks: bool = False,
    ) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        # foreach_optimizer_fallbacks during step(); off by default so recorded runs keep their exact numbers.
        self.foreach_fallbacks = foreach_fallbacks
        self.ddp_model = _wrap_ddp(model, parallel, distributed_optimizer)
        self.ddp_model.broadcast_params()
        opt_config = OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=eps,
            clip_grad=clip_grad, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=distributed_optimizer,
        )
        # No gloo groups on GPU: megatron's default (True) asserts on the missing intra-partial-DP gloo group.
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp_model], use_gloo_process_groups=False)

    def step(self) -> float:
        """Finish the gradient reduction and take the step; return megatron's gradient norm before clipping."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp_model])
        with foreach_optimizer_fallbacks(self.foreach_fallbacks):
            _, grad_norm, _ = self.optimizer.step()
        return float(grad_norm) if grad_norm is not None else float("nan")

    def _optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def state_dict(self) -> dict[str, Any]:
        """Each (chained) optimizer's state; distributed optimizer state gathered to DP rank 0 (a collective)."""
        states = []
        for opt in self._optimizers():
            entry = {"state": opt.state_dict()}
            if hasattr(opt, "get_parameter_state_dp_zero"):
                entry["param_state"] = opt.get_parameter_state_dp_zero()
            states.append(entry)
        return {"optimizers": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the same layout is required)."""
        for opt, entry in zip(self._optimizers(), state["optimizers"]):
            opt.load_state_dict(entry["state"])
            if "param_state" in entry and hasattr(opt, "load_parameter_state_from_dp_zero"):
                opt.load_parameter_state_from_dp_zero(entry["param_state"])


@dataclass(frozen=True)
class WarmupCosineSchedule:
    """LR as a pure function of the step: linear warmup to ``peak_lr``, cosine to ``min_lr`` at ``total_steps``."""

    peak_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def lr_at(self, step: int) -> float:
        """LR of 1-based ``step``: ``peak * step / warmup``, then ``min + (peak - min) * (1 + cos(pi * p)) / 2``,
        ``p = (step - warmup) / (total - warmup)`` clamped to [0, 1]."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        if decay_steps <= 0:
            return self.peak_lr if step <= self.total_steps else self.min_lr
        progress = min(max((step - self.warmup_steps) / decay_steps, 0.0), 1.0)
        return self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRScheduler:
    """Applies a :class:`WarmupCosineSchedule` to ``param_groups``; state: steps taken. megatron's groups get
    ``lr * lr_mult`` and ``weight_decay * wd_mult`` (as ``OptimizerParamScheduler``); torch's keep their decay."""

    def __init__(self, optimizer, schedule: WarmupCosineSchedule, weight_decay: float = 0.0) -> None:
        self.optimizer, self.schedule, self.weight_decay, self.num_steps = optimizer, schedule, weight_decay, 0

    def apply(self) -> float:
        """Set the LR (and megatron groups' weight decay) for the next optimizer step and return the LR."""
        lr = self.schedule.lr_at(self.num_steps + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            if "wd_mult" in group:
                group["weight_decay"] = self.weight_decay * group["wd_mult"]
        return lr

    def step(self) -> None:  # after optimizer.step()
        self.num_steps += 1

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "schedule": self.schedule.__dict__.copy()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step count (the saved schedule may differ: the config decides)."""
        self.num_steps = int(state["num_steps"])
