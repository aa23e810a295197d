"""From a training log to a record's figures: per-layer routing, efficiency, the ratios of runs
stepped in turn, and a profiled step's figures.

Efficiency figures are medians (robust to the odd slow step) over a window after warm-up, on the steps without
routing metrics (:func:`timed_rows`); routing figures average the steps with them.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from repro.errors import ReproError
from repro.io_utils import read_json
from repro.records.flops import (
    FlopsConfig,
    analytic_flops_per_iteration,
    expert_flops_per_token,
    model_flops_per_iteration,
    tflops_per_device,
)
from repro.records.run_record import ROUTING_METRICS, Efficiency, LayerRouting
from repro.records.step_log import LogRow, read_rows, timed_rows


def _window(rows: Sequence[LogRow], warmup: int, length: int | None) -> Sequence[LogRow]:
    """``length`` rows (None: all) after ``warmup``; ReproError if none is left."""
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
    for row in _window(rows, warmup, length):
        for name in ROUTING_METRICS:
            for layer, value in enumerate(row.routing.get(name) or []):
                seen.setdefault(layer, {}).setdefault(name, []).append(float(value))
    return tuple(
        LayerRouting(layer, **{name: statistics.fmean(v[name]) if name in v else None for name in ROUTING_METRICS})
        for layer, v in sorted(seen.items())
    )


def efficiency(
    rows: Sequence[LogRow], *, warmup: int, flops: FlopsConfig, global_batch_size: int, seq_length: int,
    num_devices: int = 1, length: int | None = None, mean_active_experts: float | None = None,
    backend: str | None = None, start_step: int | None = None,
) -> Efficiency:
    """Efficiency figures from a training log.

    Args:
        rows, warmup: the log (``iter_time_s``, ``tokens_per_s``: all devices together); rows skipped first.
        flops: model dimensions (``flops.top_k``: the nominal k).
        global_batch_size, seq_length: sequences per iteration, tokens per sequence.
        num_devices: devices sharing an iteration (TFLOP/s are per device).
        length: rows measured after warm-up (None: the rest); times from their :func:`timed_rows`.
        mean_active_experts: measured experts per token (default: the window's mean ``active_experts``; 1 for
            dense or expert-merging routers; None without routing metrics: measured figures None).
        backend, start_step: recorded as given (:class:`Efficiency`).

    Raises:
        ReproError: no rows left after warm-up, or a median iteration time that is not positive.
    """
    selected = timed_rows(_window(rows, warmup, length))
    iter_time_s = statistics.median(r.iter_time_s for r in selected)
    tokens_per_s = statistics.median(r.tokens_per_s for r in selected)
    if iter_time_s <= 0:
        raise ReproError(f"median iter_time_s over the window is {iter_time_s}: must be > 0")
    peaks = [r.peak_memory_bytes for r in rows if r.peak_memory_bytes > 0]  # per device
    if mean_active_experts is None:
        per_layer = [k for r in routing(rows, warmup=warmup, length=length) if (k := r.active_experts) is not None]
        mean_active_experts = statistics.fmean(per_layer) if per_layer else None
    analytic = analytic_flops_per_iteration(flops, global_batch_size, seq_length)
    measured = (None if mean_active_experts is None
                else model_flops_per_iteration(flops, global_batch_size, seq_length, mean_active_experts))
    return Efficiency(
        warmup_steps=warmup, window_steps=len(selected), iter_time_ms=iter_time_s * 1e3, tokens_per_s=tokens_per_s,
        peak_memory_bytes=max(peaks) if peaks else None, num_devices=num_devices, global_batch_size=global_batch_size,
        seq_length=seq_length, nominal_experts=float(flops.top_k), mean_active_experts=mean_active_experts,
        flops_per_iter_analytic=analytic, flops_per_iter_measured=measured,
        tflops_per_device_analytic=tflops_per_device(analytic, iter_time_s, num_devices),
        tflops_per_device_measured=None if measured is None else tflops_per_device(measured, iter_time_s, num_devices),
        expert_flops_per_token_measured=(None if mean_active_experts is None
                                         else expert_flops_per_token(flops, mean_active_experts)),
        backend=backend, flops_attention=flops.attention, start_step=start_step,
    )


# ------------------------------------------------------------------------------------------ the command's summary
def iteration_times_ms(run_dir: str | Path, warmup: int) -> list[float]:
    """Iteration times (ms) of a run's timed rows (:func:`timed_rows`) after ``warmup``; ReproError if none."""
    rows = read_rows(Path(run_dir))
    if len(rows) <= warmup:
        raise ReproError(f"{run_dir}: the log has {len(rows)} iterations, none after a warm-up of {warmup}")
    return [r.iter_time_s * 1e3 for r in timed_rows(rows[warmup:])]


def interleaved_ratios(run_dirs: dict[str, Path], *, reference: str, warmup: int,
                       window: int) -> dict[str, dict[str, Any]]:
    """Step-time ratios to ``reference`` of runs stepped in turn (:func:`repro.stats.timing_ratio`), wall and device.

    Args:
        run_dirs, reference: run label -> run directory; the label every ratio divides by (among them).
        warmup, window: the steps measured.

    Returns:
        label -> :class:`repro.stats.TimingRatio` fields plus ``device`` (same on device time, or None); runs
        with fewer than four common steps left out.
    """
    from repro.stats import timing_ratio

    if reference not in run_dirs:
        return {}
    logs = {label: list(read_rows(Path(d))) for label, d in run_dirs.items()}
    skip = set()
    for d in run_dirs.values():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            skip.add(int(json.loads((Path(d) / "config.json").read_text())["experiment"]["logging"]["trace_step"]))

    def timed(rows: list[LogRow], field: str) -> dict[int, float]:
        """``field`` by step over the timed steps of the window (no routing metrics, not the traced step)."""
        return {r.step: getattr(r, field) for r in rows[warmup:warmup + window]
                if not r.metrics_collected and r.step not in skip and getattr(r, field) is not None}

    def figures(label: str, field: str) -> dict[str, Any] | None:
        """The ratio of ``field`` over the steps both runs timed (None: fewer than four)."""
        ref, other = timed(logs[reference], field), timed(logs[label], field)
        steps = sorted(set(ref) & set(other))
        if len(steps) < 4:
            return None
        r = timing_ratio([ref[s] for s in steps], [other[s] for s in steps])
        return {k: getattr(r, k) for k in ("ratio", "low", "high", "half_width", "rounds", "batches", "lag1",
                                           "lag1_batch_means", "detectable")}

    # A step with a device time has a wall time: no device ratio without a wall one.
    return {label: {**wall, "device": figures(label, "device_time_s")} for label in run_dirs
            if label != reference and (wall := figures(label, "iter_time_s")) is not None}


def trace_figures(run_dir: Path) -> dict[str, Any] | None:
    """A run's profiled step (``trace/summary.json``): busy vs span, launches, router device time; None if absent."""
    if (t := read_json(run_dir / "trace" / "summary.json")) is None:  # missing, unreadable or not JSON
        return None
    if t.get("clock") != "cuda":
        return {"step": t.get("step"), "clock": t.get("clock")}
    return {
        "step": t["step"], "clock": "cuda", "span_ms": t["span_us"] / 1e3, "busy_ms": t["busy_us"] / 1e3,
        "busy_share": t["busy_us"] / t["span_us"] if t["span_us"] else None, "launches": t["launches"],
        "router_device_ms": (t["router_forward_us"] + t["router_backward_us"]) / 1e3,
        "router_launches": t["router_launches"], "router_calls": t["router_calls"],
    }
