"""From a training log to a record's figures: the loss curve, per-layer routing, and efficiency; and the
summary, table and text of ``python -m repro efficiency`` (:mod:`repro.efficiency`) built from its runs.

Every figure function reads :class:`repro.training.log.LogRow` rows (``repro.training.log.read_rows``). Efficiency
figures are medians over a window of steps after warm-up (the first steps carry allocator growth and
compilation; the median resists the odd slow step better than the mean), over the window's steps that did
not compute routing metrics when it has any (:func:`timed_rows`); the routing figures average the window's
steps that did.
"""

from __future__ import annotations

import dataclasses
import shlex
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from repro.errors import ReproError
from repro.report.flops import (
    FlopsConfig,
    analytic_flops_per_iteration,
    expert_flops_per_token,
    formula_name,
    measured_flops_per_iteration,
    tflops_per_device,
)
from repro.report.record import ROUTING_METRICS, Efficiency, LayerRouting, LossPoint
from repro.training.log import LogRow, read_rows, timed_rows

#: The published iteration times the summary compares the DirMoE / Switch ratio with (DirMoE paper, Table 1).
PUBLISHED_MS = {"switch": 431.5, "dirmoe": 437.3}
#: The router the summary's ratios divide by.
REFERENCE_ROUTER = "switch"


def loss_curve(rows: Sequence[LogRow]) -> tuple[LossPoint, ...]:
    """The (step, loss) curve of a training log."""
    return tuple(LossPoint(step=r.step, loss=r.loss) for r in rows)


def _window(rows: Sequence[LogRow], warmup: int, length: int | None) -> Sequence[LogRow]:
    """The rows measured: ``length`` rows (None: all) after skipping ``warmup``; ReproError where none is left."""
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
        LayerRouting(
            layer=layer,
            **{name: statistics.fmean(seen[layer][name]) if name in seen[layer] else None for name in ROUTING_METRICS},
        )
        for layer in sorted(seen)
    )


def efficiency(
    rows: Sequence[LogRow], *, warmup: int, flops: FlopsConfig, global_batch_size: int, seq_length: int,
    num_devices: int = 1, length: int | None = None, peak_memory_bytes: int | None = None,
    mean_active_experts: float | None = None, backend: str | None = None, start_step: int | None = None,
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
        start_step: the step the run started from (0: initialisation; a checkpoint's step), recorded.

    Raises:
        ReproError: no rows left after warm-up, or a median iteration time that is not positive.
    """
    selected = timed_rows(_window(rows, warmup, length))
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
        warmup_steps=warmup, window_steps=len(selected), iter_time_ms=iter_time_s * 1e3, tokens_per_s=tokens_per_s,
        peak_memory_bytes=peak_memory_bytes, num_devices=num_devices, global_batch_size=global_batch_size,
        seq_length=seq_length, nominal_experts=float(flops.top_k), mean_active_experts=mean_active_experts,
        flops_per_iter_analytic=analytic, flops_per_iter_measured=measured,
        tflops_per_device_analytic=tflops_per_device(analytic, iter_time_s, num_devices),
        tflops_per_device_measured=None if measured is None else tflops_per_device(measured, iter_time_s, num_devices),
        expert_flops_per_token_measured=(
            None if mean_active_experts is None else expert_flops_per_token(flops, mean_active_experts)
        ),
        backend=backend, flops_attention=flops.attention, start_step=start_step,
    )


# ------------------------------------------------------------------------------------------ the command's summary
def _iteration_times_ms(run_dir: str | Path, warmup: int) -> list[float]:
    """Iteration times (ms) of a run's log after ``warmup`` rows, of the steps that did not collect routing
    metrics (:func:`repro.training.log.timed_rows`); ReproError where no row is left."""
    rows = read_rows(Path(run_dir))
    if len(rows) <= warmup:
        raise ReproError(f"{run_dir}: the log has {len(rows)} iterations, none after a warm-up of {warmup}")
    return [r.iter_time_s * 1e3 for r in timed_rows(rows[warmup:])]


def _paired_times(logs: dict[str, list[LogRow]], label: str, reference: str, warmup: int, window: int,
                  field: str, skip: set[int]) -> tuple[list[float], list[float]]:
    """The two runs' ``field`` (``iter_time_s``, ``device_time_s``) over the steps both timed: after ``warmup``,
    within ``window`` steps, neither collecting routing metrics nor in ``skip`` (profiled steps)."""
    def timed(rows: list[LogRow]) -> dict[int, float]:
        return {r.step: getattr(r, field) for r in rows[warmup:warmup + window]
                if not r.metrics_collected and r.step not in skip and getattr(r, field) is not None}

    ref, other = timed(logs[reference]), timed(logs[label])
    steps = sorted(set(ref) & set(other))
    return [ref[s] for s in steps], [other[s] for s in steps]


def interleaved_ratios(
    run_dirs: dict[str, Path], *, reference: str, warmup: int, window: int
) -> dict[str, dict[str, Any]]:
    """Each run's step time over ``reference``'s, from runs stepped in turn in one process
    (:mod:`repro.training.interleave`: step ``s`` of every log is round ``s``), with the batch-means interval
    of :func:`repro.report.stats.timing_ratio`: on wall time, and on the device's span (CUDA events) where the
    logs have it.

    Args:
        run_dirs: run label -> run directory, ``reference`` among them.
        reference: the label every ratio divides by.
        warmup, window: the steps measured (as the records' efficiency window).

    Returns:
        label -> ``{"ratio", "low", "high", "half_width", "rounds", "batches", "lag1", "lag1_batch_means",
        "detectable", "device"}`` (``device``: the same on device time, or None); the reference and runs with
        fewer than four common steps are left out.
    """
    import json

    from repro.report.stats import timing_ratio

    if reference not in run_dirs:
        return {}
    logs = {label: list(read_rows(Path(d))) for label, d in run_dirs.items()}
    skip = set()
    for d in run_dirs.values():
        try:
            skip.add(int(json.loads((Path(d) / "config.json").read_text())["experiment"]["logging"]["trace_step"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    out: dict[str, dict[str, Any]] = {}
    for label in run_dirs:
        if label == reference:
            continue
        entry: dict[str, Any] | None = None
        for field in ("iter_time_s", "device_time_s"):
            ref, other = _paired_times(logs, label, reference, warmup, window, field, skip)
            if len(ref) < 4:
                if entry is not None:
                    entry["device"] = None
                continue
            r = timing_ratio(ref, other)
            figures = {"ratio": r.ratio, "low": r.low, "high": r.high, "half_width": r.half_width, "rounds": r.rounds,
                       "batches": r.batches, "lag1": r.lag1, "lag1_batch_means": r.lag1_batch_means,
                       "detectable": r.detectable}
            if entry is None:
                entry = {**figures, "device": None}
            else:
                entry["device"] = figures
        if entry is not None:
            out[label] = entry
    return out


def _trace_figures(run_dir: Path) -> dict[str, Any] | None:
    """A run's profiled step (``trace/summary.json``): device busy against the step's span, launches, the routers'
    device time; None without one."""
    import json

    try:
        t = json.loads((run_dir / "trace" / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if t.get("clock") != "cuda":
        return {"step": t.get("step"), "clock": t.get("clock")}
    return {
        "step": t["step"], "clock": "cuda", "span_ms": t["span_us"] / 1e3, "busy_ms": t["busy_us"] / 1e3,
        "busy_share": t["busy_us"] / t["span_us"] if t["span_us"] else None, "launches": t["launches"],
        "router_device_ms": (t["router_forward_us"] + t["router_backward_us"]) / 1e3,
        "router_launches": t["router_launches"], "router_calls": t["router_calls"],
    }


def _command_summary(
    plan: Any, records: dict[str, Any], errors: dict[str, str], wall_s: dict[str, float], argv: list[str]
) -> dict[str, Any]:
    """The summary JSON of ``python -m repro efficiency``: the command and its settings, the FLOPs count,
    where each run started (initialisation or a trained checkpoint's step), per-run iteration times
    (min/median/max) and figures, ratios to Switch's median iteration time, and the runs that failed.
    Arguments as :func:`write_command_outputs`."""
    runs: dict[str, Any] = {}
    for run in plan.runs:
        if run.label in errors:
            runs[run.label] = {"router": run.router, "error": errors[run.label]}
            continue
        eff = records[run.label].efficiency
        times = _iteration_times_ms(plan.run_dir(run), plan.warmup)
        runs[run.label] = {
            "router": run.router,
            "overrides": list(run.overrides),
            "init_from": run.init_from or None,
            "start_step": run.start_step,
            "iter_time_ms": {"min": min(times), "median": statistics.median(times), "max": max(times)},
            "tokens_per_s": eff.tokens_per_s,
            "tflops_per_device_analytic": eff.tflops_per_device_analytic,
            "tflops_per_device_measured": eff.tflops_per_device_measured,
            "mean_active_experts": eff.mean_active_experts,
            "peak_memory_gib": None if eff.peak_memory_bytes is None else eff.peak_memory_bytes / 2**30,
            "backend": eff.backend,
            "wall_s": round(wall_s[run.label], 1),
            "record": str(plan.run_dir(run) / "record.json"),
            "trace": _trace_figures(plan.run_dir(run)),
        }
        devices_ms = [r.device_time_s * 1e3 for r in timed_rows(read_rows(plan.run_dir(run))[plan.warmup:])
                      if r.device_time_s is not None]
        runs[run.label]["device_time_ms"] = {"median": statistics.median(devices_ms)} if devices_ms else None
    # A ratio is formed only between runs stepped in turn in one process (repro.efficiency, default 5).
    ratios = {}
    if getattr(plan, "interleave", False):
        done = {run.label: plan.run_dir(run) for run in plan.runs if run.label in runs and run.label not in errors}
        ratios = interleaved_ratios(done, reference=REFERENCE_ROUTER, warmup=plan.warmup, window=plan.iters)
    for label, entry in runs.items():
        if "iter_time_ms" in entry:
            entry["interleaved"] = ratios.get(label)
            entry["ratio_to_switch"] = 1.0 if label == REFERENCE_ROUTER and ratios else (
                ratios[label]["ratio"] if label in ratios else None)
    first = next((records[r.label] for r in plan.runs if r.label in records), None)
    config = plan.config(plan.runs[0])
    batch, seq = config.data.global_batch_size, config.seq_length
    return {
        "command": shlex.join(["python", "-m", "repro", "efficiency", *argv]),
        "flavour": plan.flavour,
        "devices": plan.devices,
        "device": first.environment.device if first else None,
        "torch": first.environment.torch if first else None,
        "megatron_core": first.environment.megatron_core if first else None,
        "micro_batch_size": config.data.micro_batch_size,
        "accumulation": config.data.num_microbatches(plan.devices // config.parallel.tp),
        "global_batch_size": batch,
        "seq_length": seq,
        "tokens_per_iteration": batch * seq,
        "vocab_size": plan.vocab_size,
        "warmup_iterations": plan.warmup,
        "measured_iterations": plan.iters,
        "flops_attention": plan.flops_attention,
        "flops_count": formula_name(plan.flops_attention),
        "timed_from": "trained checkpoints" if any(r.init_from for r in plan.runs) else "initialisation",
        "interleaved": bool(getattr(plan, "interleave", False)),
        "runs": runs,
        "dirmoe_over_switch": runs.get("dirmoe", {}).get("ratio_to_switch"),
        "published_dirmoe_over_switch": PUBLISHED_MS["dirmoe"] / PUBLISHED_MS["switch"],
        "failed": sorted(errors),
    }


def _command_table(plan: Any, records: list, summary: dict[str, Any], ledger=None):
    """The efficiency table of the command's finished runs (:func:`repro.report.tables.efficiency_table`, with
    the published numbers of ``ledger`` where given), its caption saying the tokens per iteration and where the
    runs started."""
    from repro.report.tables import efficiency_table

    table = efficiency_table(records, ledger=ledger, reference_router=REFERENCE_ROUTER)
    extra = (
        f" Tokens per iteration: {summary['global_batch_size']} x {summary['seq_length']} = "
        f"{summary['tokens_per_iteration']:,} (micro-batch {summary['micro_batch_size']} x "
        f"{summary['accumulation']} accumulation steps x {plan.devices} device(s)); synthetic tokens, vocabulary "
        f"{plan.vocab_size}; {plan.iters} iterations measured after {plan.warmup} warm-up"
    )
    if not any(r.init_from for r in plan.runs):
        extra += ", from initialisation (the recipe's first iterations)"
    extra += "."
    if ledger is not None and plan.flavour == "llama-185m":
        extra += " The papers' rows: 512 x 1024 tokens per iteration on 8 GPUs (64 sequences per GPU)."
    return dataclasses.replace(table, caption=table.caption + extra)


def _summary_text(summary: dict[str, Any]) -> str:
    """The summary's iteration times as lines of text (what the command prints)."""
    lines = [
        f"Iteration time (ms) over {summary['measured_iterations']} iterations after {summary['warmup_iterations']} "
        f"warm-up, {summary['devices']} x {summary['device']}, {summary['tokens_per_iteration']:,} tokens per iteration, "
        f"from {summary['timed_from']}:"
    ]
    for label, entry in summary["runs"].items():
        if "error" in entry:
            lines.append(f"  {label:<18} FAILED: {entry['error']}")
            continue
        t = entry["iter_time_ms"]
        ratio = f"  x switch {_ratio_text(entry['interleaved'])}" if entry.get("interleaved") else ""
        start = f"  (from step {entry['start_step']})" if entry.get("start_step") else ""
        lines.append(f"  {label:<18} min {t['min']:9.1f}  median {t['median']:9.1f}  max {t['max']:9.1f}{ratio}{start}")
    dirmoe = summary["runs"].get("dirmoe", {}).get("interleaved")
    if dirmoe:
        lines.append(
            f"DirMoE / Switch, stepped in turn in one process: {_ratio_text(dirmoe)} over {dirmoe['rounds']} rounds "
            f"(a change of {dirmoe['detectable']:.1%} is detected with 80% power; DirMoE paper, separate runs on "
            f"8 GPUs: {summary['published_dirmoe_over_switch']:.3f})"
        )
    elif not summary.get("interleaved"):
        lines.append("No ratios: runs in separate processes differ by the process as much as by the router "
                     "(interleave them on one device: drop --separate).")
    return "\n".join(lines)


def _ratio_text(figures: dict[str, Any]) -> str:
    """``1.032 [1.021, 1.043]`` (geometric-mean ratio and its 95% interval)."""
    return f"{figures['ratio']:.3f} [{figures['low']:.3f}, {figures['high']:.3f}]"


def write_command_outputs(
    plan: Any, records: dict[str, Any], errors: dict[str, str], wall_s: dict[str, float], argv: list[str]
) -> None:
    """Write and print what ``python -m repro efficiency`` leaves in ``plan.out_dir``: the table of the finished
    runs in every format of ``plan.formats`` and ``summary.json``.

    Args:
        plan: the command's :class:`repro.efficiency.EfficiencyPlan`.
        records: the finished runs' records, by run label.
        errors: the failed runs' one-line errors, by run label.
        wall_s: each run's wall time, by run label.
        argv: the command's arguments.
    """
    from repro.io_utils import write_json_atomic
    from repro.report.ledger import load_ledger
    from repro.report.table_core import render, write_tables

    summary = _command_summary(plan, records, errors, wall_s, argv)
    measured = [records[r.label] for r in plan.runs if r.label in records]
    if measured:
        table = _command_table(plan, measured, summary, ledger=load_ledger() if plan.published else None)
        for path in write_tables([table], plan.out_dir, plan.formats):
            print(f"wrote {path}")
        print("\n" + render(table, "md"))
    write_json_atomic(Path(plan.out_dir) / "summary.json", summary)
    print(_summary_text(summary))
    print(f"wrote {Path(plan.out_dir) / 'summary.json'}")

