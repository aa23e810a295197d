"""The logic of ``tests/test_gpu.py`` that CPU tests exercise too (``tests/test_fusions.py``), so the GPU
tests do not rest on untested code: counting which kernels a whole-model step takes (:func:`step_counters`),
and comparing a whole model's gradients in a lower precision with an fp32 reference on the same weights
(with a deliberately wrong gradient that the comparison must catch, on CPU).

The weights are non-initial (:func:`train_steps` first): at initialisation (std 0.01 everywhere) the logits
are nearly uniform and many gradients are nearly zero or nearly alike, so a wrong gradient can hide there.
Errors are relative L2 norms, ``||g - g_ref|| / ||g_ref||``, per parameter tensor and over all of them
together. Every tensor is held to the per-tensor bound, however small its share of the total norm: the
experts' gradients are a small share at these scales, and they are what the grouped kernel computes.

A tensor whose gradient is mostly cancellation (a nearly idle expert, a gate at its threshold) has a large
relative error under any rounding. Its own noise floor says so: the fp32 model's gradients with its weights
rounded to bf16 (:func:`bf16_rounded`), against the fp32 reference. A tensor's bound is the larger of the
per-tensor bound and :data:`FLOOR_FACTOR` times its floor, capped (:func:`tensor_bounds`). On CPU (the tiny
model, ``tests/test_fusions.py``) bf16 computation gave 2x the floor of most tensors and at most 5.6x that of any
tensor, whose errors were then under 0.01; a wrong gradient is off by O(1) against a floor of 0.003-0.05 and
still fails.

The caps are what make the floor safe: without them a tensor whose floor is 0.25 or more would pass with its
gradient zeroed (relative error 1). A halved gradient ``(g_ref + d) / 2`` of a tensor whose honest error is
``e = ||d|| / ||g_ref||`` has a relative error of at least ``(1 - e) / 2``; so a tensor holding at least
:data:`MIN_CAPPED_SHARE` of the reference's squared norm is capped at :data:`TENSOR_CAP` (0.35): zeroed, it
fails always, halved whenever ``e < 0.3``. On an H100 no tensor holding 1e-4 of the norm or more measured above
0.161 (ReMoE's router weights; ``results/h100/bf16-norms``). A tensor of a smaller share (a layer's experts whose
gradients nearly cancel, a norm weight: Switch's layer-8 experts held 5.4e-7 and measured 0.185 on an H100) can
be moved by O(1) by a few tokens routed elsewhere in bf16, so its floor may widen its bound further, up to
:data:`SMALL_SHARE_CAP` (0.9): zeroed, it still fails; an honest error that large would mean the tensor's
gradient cannot be checked at this precision at all, which a failure should say.
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Callable

import pytest
import torch

import routers

#: A tensor's bound is at least this multiple of its own noise floor (module docstring).
FLOOR_FACTOR = 4.0
#: No bound above this for a tensor holding :data:`MIN_CAPPED_SHARE` or more of the norm, whatever its floor:
#: below 0.5, so a halved or zeroed gradient fails (module docstring).
TENSOR_CAP = 0.35
#: The share of the reference's total squared gradient norm from which a tensor's bound is :data:`TENSOR_CAP`.
MIN_CAPPED_SHARE = 1e-4
#: No bound above this for any tensor: below 1, so a zeroed gradient fails (module docstring).
SMALL_SHARE_CAP = 0.9


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


def bf16_rounded(state: dict[str, object]) -> dict[str, object]:
    """A state dict with every floating-point tensor rounded to bf16 and back to its dtype, except the routers'
    (``.mlp.router.`` in the name), which a bf16 model keeps in fp32: the weights a bf16 copy computes with."""
    return {
        name: value.to(torch.bfloat16).to(value.dtype)
        if torch.is_tensor(value) and value.is_floating_point() and ".mlp.router." not in name
        else value
        for name, value in state.items()
    }


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


def tensor_bounds(
    reference: dict[str, torch.Tensor],
    *,
    tensor_rtol: float,
    router_rtol: float | None = None,
    floor: dict[str, float] | None = None,
) -> dict[str, float]:
    """Each tensor's bound on its relative error (module docstring).

    Args:
        reference: the fp32 reference gradients (their shares of the norm decide which bounds are capped).
        tensor_rtol: the bound of every tensor but the routers'.
        router_rtol: the bound of the routers' own tensors (``.mlp.router.`` in the name); ``None``:
            ``tensor_rtol``.
        floor: each tensor's noise floor (its relative error with the weights rounded to bf16, fp32 maths:
            :func:`bf16_rounded`); a tensor's bound is then at least :data:`FLOOR_FACTOR` times its floor.

    Every bound is at most :data:`TENSOR_CAP` for a tensor holding :data:`MIN_CAPPED_SHARE` of the norm or more,
    and at most :data:`SMALL_SHARE_CAP` for any other.

    Returns:
        ``{name: bound}`` for every tensor of ``reference``.
    """
    _, share, _ = gradient_errors(reference, reference)
    bounds = {}
    for name in reference:
        bound = router_rtol if router_rtol is not None and ".mlp.router." in name else tensor_rtol
        if floor is not None:
            bound = max(bound, FLOOR_FACTOR * floor[name])
        bounds[name] = min(bound, TENSOR_CAP if share[name] >= MIN_CAPPED_SHARE else SMALL_SHARE_CAP)
    return bounds


def gradient_mismatches(
    actual: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    *,
    tensor_rtol: float,
    overall_rtol: float,
    router_rtol: float | None = None,
    floor: dict[str, float] | None = None,
) -> list[str]:
    """What is out of tolerance, one line each (empty: the gradients agree).

    Args:
        actual: the gradients under test (:func:`model_gradients`).
        reference: the fp32 reference on the same weights and batch.
        tensor_rtol, router_rtol, floor: each tensor's bound (:func:`tensor_bounds`).
        overall_rtol: bound on the relative error over all tensors.
    """
    per_tensor, share, overall = gradient_errors(actual, reference)
    bounds = tensor_bounds(reference, tensor_rtol=tensor_rtol, router_rtol=router_rtol, floor=floor)
    lines = [f"overall relative error {overall:.3g} > {overall_rtol:g}"] if overall > overall_rtol else []
    for name, err in per_tensor.items():
        if err > bounds[name]:
            lines.append(f"{name}: relative error {err:.3g} > {bounds[name]:.3g} (share of the norm {share[name]:.2g})")
    return lines


# ------------------------------------------------------------------------ the GPU test files' fixtures
#: A test may leave this much more device memory allocated than it found (process-wide state a first use
#: creates: cuBLAS workspaces, compiled kernels' buffers); a leaked LLaMA-185M with its gradients or optimizer
#: state holds more than that.
LEAK_SLACK_BYTES = 1 << 30


@pytest.fixture(scope="module", autouse=True)
def gpu_distributed():
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from repro.model.parallel import destroy_distributed, init_distributed

    yield init_distributed(tp=1, ep=1, seed=1)
    get_moe_layer_wise_logging_tracker().clear()
    destroy_distributed()


@pytest.fixture(autouse=True)
def gpu_free_memory(request):
    """(Autouse in the GPU test files.) Each test builds full-size models: give their memory back before the next one, and fail the test whose
    models outlive it (rather than a later test, out of memory)."""
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    yield
    # pytest keeps a failed test's exception for a post-mortem (sys.last_*, after --pdb has run): its traceback
    # holds the test's frames and so its models.
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        grown = torch.cuda.memory_allocated() - before
        assert grown <= LEAK_SLACK_BYTES, f"{request.node.name} left {grown / 2**30:.2f} GiB allocated on the GPU"
