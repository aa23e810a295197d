"""Backend choice for megatron-core 0.16.1 models, and the kernel plumbing of the TransformerEngine-free
``"torch"`` backend (grouped-GEMM experts and SDPA attention, modules in :mod:`repro.model.torch_backend`).

Rationale and defaults 1-3 (:class:`TorchBackendOptions`): docs/efficiency.md, "Model backends".
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "te", "torch", "local")

@dataclass(frozen=True)
class TorchBackendOptions:
    """The torch backend's switchable defaults (numbered 1-3 in docs/efficiency.md).

    Args:
        expert_gemm: ``"auto"`` (grouped kernel where usable, else exact loop), ``"grouped_mm"`` (or error), ``"loop"``.
        zero_empty_expert_grads: zero the grouped kernel's weight gradient of token-less experts.
        causal_mask: ``"verify"`` (check a mask once), ``"trust"`` (TE: causal type ignores it), ``"explicit"``.
    """

    expert_gemm: str = "auto"
    zero_empty_expert_grads: bool = True
    causal_mask: str = "verify"

    def __post_init__(self) -> None:
        for name, valid in (("expert_gemm", ("auto", "grouped_mm", "loop")),
                            ("causal_mask", ("verify", "trust", "explicit"))):
            if getattr(self, name) not in valid:
                raise ValueError(f"unknown {name} '{getattr(self, name)}'; valid: {', '.join(valid)}")
        if not isinstance(self.zero_empty_expert_grads, bool):
            raise ValueError(f"zero_empty_expert_grads must be a bool, got {self.zero_empty_expert_grads!r}")


def te_available() -> bool:
    """Whether TransformerEngine is importable and a GPU is present (never on the CPU machines)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # the bare meta package raises at import on machines without CUDA
        return False
    return True


def resolve_backend(backend: str | None = "auto") -> str:
    """Concrete backend; ``"auto"``/None: ``"te"`` if usable, ``"torch"`` on GPU, else ``"local"`` (ValueError)."""
    requested = "auto" if backend is None else backend
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend '{requested}'; valid: {', '.join(BACKENDS)}")
    if requested == "te" and not te_available():
        raise ValueError("backend 'te' needs TransformerEngine on a GPU, which this machine lacks; "
                         f"valid here: {', '.join(b for b in BACKENDS if b != 'te')}")
    if requested == "auto":
        return "te" if te_available() else "torch" if torch.cuda.is_available() else "local"
    return requested


def _grouped_mm_op():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` row-major with a 16-byte aligned data pointer (the CUDA kernel's requirement), copying if not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ w[e].t()`` by grouped GEMM both ways; ``offs_E``: int32 cumulative row
    ends; ``empty_experts``: weight gradients zeroed (option 2)."""

    @staticmethod
    def forward(ctx, x_MK, w_ENK, offs_E, empty_experts):
        x_MK = _aligned(x_MK)
        ctx.save_for_backward(x_MK, w_ENK, offs_E)
        ctx.empty_experts = empty_experts
        return _grouped_mm_op()(x_MK, w_ENK.transpose(-2, -1), offs=offs_E)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_ENK, offs_E = ctx.saved_tensors
        # torch's own formula fails on a non-contiguous incoming gradient (e.g. from an expand).
        dy_MN = _aligned(dy_MN)
        dx_MK = dw_ENK = None
        if ctx.needs_input_grad[0]:
            dx_MK = _grouped_mm_op()(dy_MN, w_ENK, offs=offs_E)
        if ctx.needs_input_grad[1]:
            dw_ENK = _grouped_mm_op()(dy_MN.t(), x_MK, offs=offs_E)
            if ctx.empty_experts:
                dw_ENK[list(ctx.empty_experts)] = 0
        return dx_MK, dw_ENK, None, None


def _loop_linear(x_MK: torch.Tensor, w_ENK: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The exact per-expert loop (``SequentialMLP``'s GEMMs): ``cat_e(x_e @ w_e.t())``."""
    outputs = [torch.matmul(x_e, w_e.t()) for x_e, w_e in zip(torch.split(x_MK, counts), w_ENK.unbind(0))]
    return torch.cat(outputs, dim=0)


@functools.cache
def _kernel_self_check(device: str, dtype: torch.dtype) -> bool:
    """Cached check that the grouped kernel matches the loop (gradients, empty groups); autograd forced on, else a
    first call under ``inference_mode`` would fail and keep the kernel off for the process."""
    try:
        with torch.inference_mode(False), torch.enable_grad():
            g = torch.Generator().manual_seed(0)
            x = torch.randn(7, 16, generator=g).to(device=device, dtype=dtype).requires_grad_()
            w = torch.randn(3, 8, 16, generator=g).to(device=device, dtype=dtype).requires_grad_()
            counts = [3, 0, 4]
            offs = torch.tensor([3, 3, 7], dtype=torch.int32, device=device)
            dy = torch.randn(7, 8, generator=g).to(device=device, dtype=dtype)
            y = _GroupedLinear.apply(x, w, offs, (1,))
            dx, dw = torch.autograd.grad(y, (x, w), dy)
            y_ref = _loop_linear(x, w, counts)
            dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return all(
            torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
            for a, b in ((y, y_ref), (dx, dx_ref), (dw, dw_ref))
        ) and bool((dw[1] == 0).all())
    except Exception:  # the op is missing, unimplemented for this device/dtype, or its checks refuse
        return False


def grouped_mm_unusable_reason(x_MK: torch.Tensor, w_ENK: torch.Tensor, *,
                               in_features: int | None = None) -> str | None:
    """Why torch's grouped kernel should not run ``x_MK @ w_e.t()`` here, or None if it should.

    Args:
        x_MK: ``[M, K]`` tokens of all experts, grouped by expert.
        w_ENK: ``[E, N, K]`` one weight per expert.
        in_features: K for an input not computed yet (then ``x_MK`` gives its dtype, device and M).
    """
    if _grouped_mm_op() is None:
        return f"torch {torch.__version__} has neither torch.nn.functional.grouped_mm nor torch._grouped_mm"
    if x_MK.dtype != w_ENK.dtype or x_MK.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtypes {x_MK.dtype}/{w_ENK.dtype}: the kernel takes one of float32, bfloat16, float16"
    device = x_MK.device
    if device.type == "cuda":
        major = torch.cuda.get_device_capability(device)[0]
        if x_MK.dtype != torch.bfloat16 or major not in (9, 10):
            # torch itself would loop (after a host sync) for anything else: our loop is no slower.
            return f"on CUDA the grouped kernel takes bf16 on sm90/sm100 only (got {x_MK.dtype}, sm{major}x)"
        if w_ENK.data_ptr() % 16:
            return "the expert weights are not 16-byte aligned"
    elif device.type != "cpu":
        return f"device type '{device.type}' is not supported"
    align = 16 // x_MK.element_size()
    M = x_MK.shape[0]
    K = x_MK.shape[1] if in_features is None else in_features
    N = w_ENK.shape[1]
    if K % align or N % align:
        return f"dimensions {K} and {N} are not multiples of {align} elements (16 bytes)"
    if M == 0:
        return "no tokens"
    if not _kernel_self_check(str(device), x_MK.dtype):
        return f"the grouped kernel failed its self-check on {device} in {x_MK.dtype}"
    return None


def grouped_linear(x_MK: torch.Tensor, w_ENK: torch.Tensor, counts: list[int], *, offs_E: torch.Tensor | None = None,
                   use_kernel: bool = True, zero_empty_grads: bool = True) -> torch.Tensor:
    """Per-expert linear map ``y_e = x_e @ w_e.t()`` over rows grouped by expert (autograd-aware).

    Args:
        x_MK: ``[M, K]`` rows grouped by expert (``counts[e]`` rows of expert e, in order).
        w_ENK: ``[E, N, K]`` megatron's ``[out, in]`` weights, stacked.
        counts: ``E`` row counts summing to M (zeros allowed).
        offs_E: int32 cumulative ends of ``counts`` on x's device (computed when None).
        use_kernel: grouped kernel (caller checked :func:`grouped_mm_unusable_reason`); False: exact loop.
        zero_empty_grads: zero the kernel's weight gradient of experts with no rows.
    """
    if not use_kernel:
        return _loop_linear(x_MK, w_ENK, counts)
    if offs_E is None:
        offs_E = offsets(counts, x_MK.device)
    empty = tuple(e for e, c in enumerate(counts) if c == 0) if zero_empty_grads else ()
    return _GroupedLinear.apply(x_MK, w_ENK, offs_E, empty)


def offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """The int32 cumulative ends of ``counts`` (the kernel's ``offs``), built on the host and copied to ``device``."""
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32).to(device, non_blocking=True)
