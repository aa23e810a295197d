"""The optimizer side of a training step, behind one small interface for CPU and GPU: both wrap the model in
megatron-core's ``DistributedDataParallel`` (:mod:`repro.training.distributed`); the CPU path steps torch's
AdamW (megatron's optimizer allocates on CUDA), the GPU path megatron's. Weight decay follows megatron: none
on biases and 1-D parameters (norm weights, router biases).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from repro.training.distributed import Parallel, clip_gradients, is_expert_param


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups, decayed (>= 2-D weights) then not decayed (biases, 1-D parameters), empty ones
    dropped (a fixed order, so that optimizer state loads back)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 or name.endswith(".bias") else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _wrap_ddp(model: nn.Module, parallel: Parallel, distributed_optimizer: bool) -> nn.Module:
    """megatron-core's ``DistributedDataParallel`` around ``model`` (fp32 grad buffers, no overlap), expert
    parameters marked ``allreduce=False`` first when EP > 1 (megatron's DDP splits them by that attribute,
    which its layers set only when their config has ``expert_model_parallel_size > 1``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if parallel.ep_size > 1:
        for name, p in model.named_parameters():
            if is_expert_param(name, p):
                p.allreduce = False
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def foreach_multi_tensor_l2_norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], per_tensor: bool,
    *args: Any,
) -> tuple[torch.Tensor, None]:
    """Drop-in for megatron-core's ``local_multi_tensor_l2_norm`` (its fallback for ``amp_C.multi_tensor_l2norm``
    without TransformerEngine or Apex) that stays on the device.

    megatron's fallback builds ``torch.tensor([torch.norm(t) for t in ...])``: one device-to-host copy per
    gradient tensor, then one more for ``float(total)`` and a host-to-device copy back, every step. Here
    ``torch._foreach_norm`` (a few multi-tensor kernels) and one reduction, no synchronisation. Each tensor's
    norm is accumulated in fp32, as ``amp_C``'s kernel does (megatron's fallback rounds a bf16 tensor's norm to
    bf16 first); the fp32 results differ from the fallback's by reduction order only.

    Args:
        chunk_size, noop_flag: ``multi_tensor_applier``'s arguments, unused (as by megatron's fallback).
        tensor_lists: lists of tensors on one device; the norm is over all of them together.
        per_tensor: unused; megatron's fallback returns no per-tensor norms either.

    Returns:
        The global L2 norm as a float32 tensor of shape [1] on the tensors' device, and None.
    """
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_multi_tensor_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], scale: float
) -> None:
    """Drop-in for megatron-core's ``local_multi_tensor_scale`` (``dst.copy_(src * scale)`` tensor by tensor):
    the same values bit for bit (the same elementwise product, the same cast on the copy) in a few multi-tensor
    kernels instead of two launches per tensor.

    Args:
        chunk_size, noop_flag: ``multi_tensor_applier``'s arguments, unused (as by megatron's fallback).
        tensor_lists: ``[sources, destinations]``, paired; the same list twice scales in place (gradient
            clipping); scale 1.0 copies (main parameters to the bf16 model's and back).
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
    """Within the block, megatron-core's optimizer uses :func:`foreach_multi_tensor_l2_norm` and
    :func:`foreach_multi_tensor_scale` where it would use its local (TE- and Apex-free) fallbacks; the module
    attributes are put back on exit, so nothing outlives the block (other runs in the process, tests).

    Only names bound to megatron's own fallbacks are replaced: with TransformerEngine or Apex installed their
    fused kernels stay. The names are read by megatron at call time (``get_grad_norm_fp32``,
    ``clip_grad_by_total_norm_fp32``, ``_multi_tensor_copy_this_to_that``), so the block must span the
    optimizer's ``step()``.

    Args:
        enabled: False leaves everything as it is (a no-op block).

    Yields:
        The ``module.name`` attributes replaced (empty when disabled or when none is a local fallback).
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
    """What both paths share: ``ddp_model`` (the wrapped model to run forward/backward through) and the
    optimizer's ``param_groups`` (the LR scheduler writes ``lr`` into them)."""

    ddp_model: nn.Module
    optimizer: Any

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def release(self) -> None:
        """Let the model go once its run is over (nothing may use this object afterwards): :func:`release_ddp`."""
        release_ddp(self.ddp_model)


def release_ddp(ddp_model: nn.Module) -> None:
    """Let a model wrapped in megatron's DDP go once its training is over (nothing may use the wrapper after).

    megatron's DDP wrapper hooks the parameters' gradient accumulators with closures over itself, and the
    model keeps the last step's routing probabilities (megatron's alltoall dispatcher), whose autograd graph
    reaches those accumulators: a cycle through C++ that the garbage collector cannot see, which would keep
    the model, its memory and its process groups' polling threads alive for the life of the process (a
    notebook or a test session training many runs). Emptying the wrapper breaks the cycle.
    """
    ddp_model.__dict__.clear()


class CpuOptimization(_Optimization):
    """megatron-core's DDP gradient reduction (on CPU under gloo with the CPU shims: backward hooks fill its fp32
    ``main_grad`` buffers, ``finalize_model_grads`` reduces them), then global-norm clipping
    (:func:`~repro.training.distributed.clip_gradients`) and torch's AdamW; ``clip_grad`` 0 does not clip.
    """

    def __init__(
        self,
        model: nn.Module,
        parallel: Parallel,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float,
    ) -> None:
        self.model = model
        self.parallel = parallel
        self.clip_grad = clip_grad
        self.ddp_model = _wrap_ddp(model, parallel, distributed_optimizer=False)
        # fused: torch's CPU kernel, one pass over each parameter and its state (a third of the single-tensor
        # loop's time on the tiny model); elementwise, so deterministic and identical whatever the layout.
        self.optimizer = torch.optim.AdamW(
            param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=True
        )

    def zero_grad(self) -> None:
        """Zero megatron's grad buffers and drop the gradients before a step's first backward."""
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

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

    def state_dict(self) -> dict[str, Any]:
        """The AdamW state (moments, step counts)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.optimizer.load_state_dict(state)


class MegatronOptimization(_Optimization):  # pragma: no cover - needs CUDA
    """megatron-core's DDP wrapper and optimizer (GPU only; fp32 main parameters for a bf16 model, the state
    sharded over data-parallel ranks with ``distributed_optimizer``)."""

    def __init__(
        self,
        model: nn.Module,
        parallel: Parallel,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float,
        bf16: bool,
        distributed_optimizer: bool,
        foreach_fallbacks: bool = False,
    ) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.parallel = parallel
        # optimizer.foreach_fallbacks: megatron's TE-free norm / scale fallbacks replaced during step()
        # (foreach_optimizer_fallbacks); off by default so that recorded runs keep their exact numbers.
        self.foreach_fallbacks = foreach_fallbacks
        self.distributed_optimizer = distributed_optimizer
        self.ddp_model = _wrap_ddp(model, parallel, distributed_optimizer)
        self.ddp_model.broadcast_params()
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=weight_decay,
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            adam_eps=eps,
            clip_grad=clip_grad,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=distributed_optimizer,
        )
        # No gloo groups: init_distributed creates none on GPU (NCCL), and megatron's default (True) asserts
        # on the missing intra-partial-data-parallel gloo group as soon as it builds the optimizer.
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp_model], use_gloo_process_groups=False)

    def zero_grad(self) -> None:
        """Zero megatron's grad buffers and the optimizer's gradients."""
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()

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
        """Each (chained) optimizer's state; with the distributed optimizer, its parameter state gathered
        to data-parallel rank 0 (a collective)."""
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
