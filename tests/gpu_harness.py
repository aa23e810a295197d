"""The logic of ``tests/test_gpu.py`` that CPU tests exercise too (``tests/test_fusions.py``), so the GPU
tests do not rest on untested code: counting which kernels a whole-model step takes (:func:`step_counters`),
and comparing a whole model's gradients in a lower precision with an fp32 reference on the same weights
(with a deliberately wrong gradient that the comparison must catch, on CPU).

The weights are non-initial (:func:`train_steps` first): at initialisation (std 0.01 everywhere) the logits
are nearly uniform and many gradients are nearly zero or nearly alike, so a wrong gradient can hide there.
Errors are relative L2 norms, ``||g - g_ref|| / ||g_ref||``, per parameter tensor and over all of them
together. Every tensor is held to the per-tensor bound, however small its share of the total norm: the
experts' gradients are a small share at these scales, and they are what the grouped kernel computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

import routers


def step_counters(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Record, until ``monkeypatch`` is undone, what the torch backend runs: ``kernel`` (torch's grouped GEMM
    through ``_GroupedLinear``, one per projection and forward), ``loop`` (the per-expert loop instead),
    ``swiglu`` (megatron's fused weighted SwiGLU) and ``sdpa`` (one ``(is_causal, mask is None, dtype)`` per
    attention call). The grouped kernel's one-time self-check is run first, so it is not counted.

    Returns:
        ``{name: [one entry per call]}``, filled as the model runs.
    """
    import torch.nn.functional as F

    from repro.model import backends, torch_backend

    calls: dict[str, list] = {"kernel": [], "loop": [], "swiglu": [], "sdpa": []}

    def counting(key, real):
        return lambda *args, **kwargs: calls[key].append(1) or real(*args, **kwargs)

    real_sdpa = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        calls["sdpa"].append((kwargs.get("is_causal"), kwargs.get("attn_mask") is None, args[0].dtype))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(backends._GroupedLinear, "apply", counting("kernel", backends._GroupedLinear.apply))
    monkeypatch.setattr(backends, "_loop_linear", counting("loop", backends._loop_linear))
    monkeypatch.setattr(torch_backend, "weighted_bias_swiglu_impl", counting("swiglu", torch_backend.weighted_bias_swiglu_impl))
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return calls


def train_steps(model: torch.nn.Module, loss_fn: Callable[[int], torch.Tensor], steps: int, lr: float = 1e-3) -> list[float]:
    """``steps`` AdamW steps on ``loss_fn(step)`` (the routers' schedules driven as the trainer does).

    Returns:
        The losses.
    """
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        routers.begin_step(model, step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(step)
        loss.backward()
        optimizer.step()
        routers.end_step(model)
        losses.append(float(loss))
    return losses


def model_gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradient of ``loss`` for every parameter that gets one, as fp32 copies, by parameter name."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}


def gradient_errors(
    actual: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> tuple[dict[str, float], dict[str, float], float]:
    """Relative L2 errors of ``actual`` against ``reference``.

    Returns:
        ``(per_tensor, share, overall)``: each tensor's relative error, each tensor's share of the reference's
        total squared norm, and the error over all tensors together.

    Raises:
        ValueError: the two hold gradients of different parameters or shapes.
    """
    if actual.keys() != reference.keys():
        raise ValueError(f"gradients of different parameters: {sorted(actual.keys() ^ reference.keys())[:5]}")
    per_tensor, share = {}, {}
    diff_sq = ref_sq = 0.0
    for name, ref in reference.items():
        if actual[name].shape != ref.shape:
            raise ValueError(f"{name}: shape {tuple(actual[name].shape)} against {tuple(ref.shape)}")
        d, r = float((actual[name] - ref).norm()) ** 2, float(ref.norm()) ** 2
        per_tensor[name] = math.sqrt(d / r) if r > 0 else (0.0 if d == 0 else math.inf)
        share[name] = r
        diff_sq, ref_sq = diff_sq + d, ref_sq + r
    share = {name: r / ref_sq if ref_sq > 0 else 0.0 for name, r in share.items()}
    return per_tensor, share, math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else 0.0


def gradient_mismatches(
    actual: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    *,
    tensor_rtol: float,
    overall_rtol: float,
    router_rtol: float | None = None,
) -> list[str]:
    """What is out of tolerance, one line each (empty: the gradients agree).

    Args:
        actual: the gradients under test (:func:`model_gradients`).
        reference: the fp32 reference on the same weights and batch.
        tensor_rtol: bound on each tensor's relative error.
        overall_rtol: bound on the relative error over all tensors.
        router_rtol: bound on each of the routers' own tensors (``.mlp.router.`` in the name) instead of
            ``tensor_rtol``; ``None``: ``tensor_rtol``.
    """
    per_tensor, share, overall = gradient_errors(actual, reference)
    lines = [f"overall relative error {overall:.3g} > {overall_rtol:g}"] if overall > overall_rtol else []
    for name, err in per_tensor.items():
        bound = router_rtol if router_rtol is not None and ".mlp.router." in name else tensor_rtol
        if err > bound:
            lines.append(f"{name}: relative error {err:.3g} > {bound:g} (share of the norm {share[name]:.2g})")
    return lines
