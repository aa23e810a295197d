"""From a training log to a record's figures: the loss curve, per-layer routing, and efficiency.

Every function reads :class:`repro.training.log.LogRow` rows (``repro.training.log.read_rows``). Efficiency
figures are medians over a window of steps after warm-up (the first steps carry allocator growth and
compilation; the median resists the odd slow step better than the mean), over the window's steps that did
not compute routing metrics when it has any (:func:`timed_rows`); the routing figures average the window's
steps that did.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from repro.errors import ReproError
from repro.report.flops import (
    FlopsConfig,
    analytic_flops_per_iteration,
    expert_flops_per_token,
    measured_flops_per_iteration,
    tflops_per_device,
)
from repro.report.record import ROUTING_METRICS, Efficiency, LayerRouting, LossPoint
from repro.training.log import LogRow, timed_rows


def loss_curve(rows: Sequence[LogRow]) -> tuple[LossPoint, ...]:
    """The (step, loss) curve of a training log."""
    return tuple(LossPoint(step=r.step, loss=r.loss) for r in rows)


def window(rows: Sequence[LogRow], warmup: int, length: int | None) -> Sequence[LogRow]:
    """The rows measured: ``length`` rows (None: all) after skipping ``warmup``.

    Raises:
        ReproError: bad bounds, or no row left to measure.
    """
    if warmup < 0 or (length is not None and length < 1):
        raise ReproError(f"need warmup >= 0 and window >= 1, got warmup={warmup}, window={length}")
    selected = rows[warmup:] if length is None else rows[warmup : warmup + length]
    if not selected:
        raise ReproError(f"the log has {len(rows)} steps and warm-up skips {warmup}: no steps left to measure")
    return selected


def routing(rows: Sequence[LogRow], *, warmup: int = 0, length: int | None = None) -> tuple[LayerRouting, ...]:
    """Per-layer routing metrics (:data:`ROUTING_METRICS`) averaged over the rows of a window.

    Returns:
        One :class:`LayerRouting` per layer seen, by layer index; empty when no row has routing metrics.
    """
    seen: dict[int, dict[str, list[float]]] = {}
    for row in window(rows, warmup, length):
        for name in ROUTING_METRICS:
            for layer, value in enumerate(row.routing.get(name) or []):
                seen.setdefault(layer, {}).setdefault(name, []).append(float(value))
    return tuple(
        LayerRouting(
            layer=layer,
            **{name: statistics.fmean(seen[layer][name]) if name in seen[layer] else None for name in ROUTING_METRICS},
        )
        for layer in sorted(seen)
    )


def efficiency(
    rows: Sequence[LogRow],
    *,
    warmup: int,
    flops: FlopsConfig,
    global_batch_size: int,
    seq_length: int,
    num_devices: int = 1,
    length: int | None = None,
    peak_memory_bytes: int | None = None,
    mean_active_experts: float | None = None,
    backend: str | None = None,
) -> Efficiency:
    """Efficiency figures from a training log.

    Args:
        rows: the log (``iter_time_s`` and ``tokens_per_s`` count all devices together).
        warmup: rows skipped at the start.
        flops: model dimensions for the FLOPs count (``flops.top_k`` is the nominal k).
        global_batch_size: sequences per iteration.
        seq_length: tokens per sequence.
        num_devices: devices sharing an iteration (TFLOP/s are per device).
        length: rows measured after the warm-up (None: all the rest); the times are those of
            :func:`timed_rows` among them.
        peak_memory_bytes: peak memory per device; default: the largest ``peak_memory_bytes`` of the rows.
        mean_active_experts: measured experts per token; default: the mean over layers and window rows of
            ``active_experts``. Pass 1 for a dense model or a router that merges experts. None and no
            routing metrics in the log: the measured figures are None.
        backend: the model's backend, recorded with the figures.

    Returns:
        An :class:`Efficiency`.

    Raises:
        ReproError: no rows left after warm-up, or a median iteration time that is not positive.
    """
    selected = timed_rows(window(rows, warmup, length))
    iter_time_s = statistics.median(r.iter_time_s for r in selected)
    tokens_per_s = statistics.median(r.tokens_per_s for r in selected)
    if iter_time_s <= 0:
        raise ReproError(f"median iter_time_s over the window is {iter_time_s}: must be > 0")
    if peak_memory_bytes is None:
        peaks = [r.peak_memory_bytes for r in rows if r.peak_memory_bytes > 0]
        peak_memory_bytes = max(peaks) if peaks else None
    if mean_active_experts is None:
        per_layer = [r.active_experts for r in routing(rows, warmup=warmup, length=length)]
        per_layer = [k for k in per_layer if k is not None]
        mean_active_experts = statistics.fmean(per_layer) if per_layer else None
    analytic = analytic_flops_per_iteration(flops, global_batch_size, seq_length)
    measured = None
    if mean_active_experts is not None:
        measured = measured_flops_per_iteration(flops, global_batch_size, seq_length, mean_active_experts)
    return Efficiency(
        warmup_steps=warmup,
        window_steps=len(selected),
        iter_time_ms=iter_time_s * 1e3,
        tokens_per_s=tokens_per_s,
        peak_memory_bytes=peak_memory_bytes,
        num_devices=num_devices,
        global_batch_size=global_batch_size,
        seq_length=seq_length,
        nominal_experts=float(flops.top_k),
        mean_active_experts=mean_active_experts,
        flops_per_iter_analytic=analytic,
        flops_per_iter_measured=measured,
        tflops_per_device_analytic=tflops_per_device(analytic, iter_time_s, num_devices),
        tflops_per_device_measured=None if measured is None else tflops_per_device(measured, iter_time_s, num_devices),
        expert_flops_per_token_measured=(
            None if mean_active_experts is None else expert_flops_per_token(flops, mean_active_experts)
        ),
        backend=backend,
    )


__all__ = ["efficiency", "loss_curve", "routing", "window"]
