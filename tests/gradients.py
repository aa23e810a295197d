"""Comparing a whole model's gradients in a lower precision with an fp32 reference on the same weights.

Used by ``tests/test_gpu.py`` (LLaMA-185M, bf16 against fp32 on an H100) and exercised on CPU by
``tests/test_backends.py`` (the tiny model, with a deliberately wrong gradient that it must catch), so the
GPU test's logic is not untested.

The weights are non-initial (:func:`train_steps` first): at initialisation (std 0.01 everywhere) the logits
are nearly uniform and many gradients are nearly zero or nearly alike, so a wrong gradient can hide there.
Errors are relative L2 norms, ``||g - g_ref|| / ||g_ref||``, per parameter tensor and over all of them
together. Every tensor is held to the per-tensor bound, however small its share of the total norm: the
experts' gradients are a small share at these scales, and they are what the grouped kernel computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

import routers


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
) -> list[str]:
    """What is out of tolerance, one line each (empty: the gradients agree).

    Args:
        actual: the gradients under test (:func:`model_gradients`).
        reference: the fp32 reference on the same weights and batch.
        tensor_rtol: bound on each tensor's relative error.
        overall_rtol: bound on the relative error over all tensors.
    """
    per_tensor, share, overall = gradient_errors(actual, reference)
    lines = [f"overall relative error {overall:.3g} > {overall_rtol:g}"] if overall > overall_rtol else []
    for name, err in per_tensor.items():
        if err > tensor_rtol:
            lines.append(f"{name}: relative error {err:.3g} > {tensor_rtol:g} (share of the norm {share[name]:.2g})")
    return lines
