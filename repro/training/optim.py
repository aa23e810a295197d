"""The optimizer side of a training step, behind one small interface for CPU and GPU: both wrap the model in
megatron-core's ``DistributedDataParallel`` (:mod:`repro.training.distributed`); the CPU path steps torch's
AdamW (megatron's optimizer allocates on CUDA), the GPU path megatron's. Weight decay follows megatron: none
on biases and 1-D parameters (norm weights, router biases).
"""

from __future__ import annotations

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
    ) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.parallel = parallel
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
