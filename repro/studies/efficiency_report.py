"""What ``python -m repro study efficiency`` leaves in its output folder: ``summary.json`` (settings, per-run
iteration times and figures, ratios to Switch of runs stepped in turn), the efficiency table and the printed text.
"""

from __future__ import annotations

import dataclasses
import shlex
import statistics
from pathlib import Path
from typing import Any

from repro.records.flops import formula_name
from repro.records.log_figures import interleaved_ratios, iteration_times_ms, trace_figures
from repro.records.step_log import read_rows, timed_rows

#: The published iteration times the summary compares the DirMoE / Switch ratio with (DirMoE paper, Table 1).
PUBLISHED_MS = {"switch": 431.5, "dirmoe": 437.3}
#: The router the summary's ratios divide by.
REFERENCE_ROUTER = "switch"


def _command_summary(
    plan: Any, records: dict[str, Any], errors: dict[str, str], wall_s: dict[str, float], argv: list[str],
    stopped_after: int | None = None,
) -> dict[str, Any]:
    """The summary JSON: command, settings, FLOPs count, each run's start step, per-run iteration times
    (min/median/max, how many) and figures, ratios to Switch, failed runs, the step a stop signal ended the
    measurement after (None: not stopped). Arguments as :func:`write_command_outputs`."""
    # Ratios only between runs stepped in turn in one process (repro.studies.efficiency, default 5).
    done = {run.label: plan.run_dir(run) for run in plan.runs if run.label not in errors}
    ratios = (interleaved_ratios(done, reference=REFERENCE_ROUTER, warmup=plan.warmup, window=plan.iters)
              if plan.interleave else {})
    runs: dict[str, Any] = {}
    for run in plan.runs:
        if run.label in errors:
            runs[run.label] = {"router": run.router, "error": errors[run.label]}
            continue
        eff = records[run.label].efficiency
        times = iteration_times_ms(plan.run_dir(run), plan.warmup)
        devices_ms = [r.device_time_s * 1e3 for r in timed_rows(read_rows(plan.run_dir(run))[plan.warmup:])
                      if r.device_time_s is not None]
        runs[run.label] = {
            "router": run.router,
            "overrides": list(run.overrides),
            "init_from": run.init_from or None,
            "start_step": run.start_step,
            "iter_time_ms": {"min": min(times), "median": statistics.median(times), "max": max(times)},
            "iterations": len(times),
            "tokens_per_s": eff.tokens_per_s,
            "tflops_per_device_analytic": eff.tflops_per_device_analytic,
            "tflops_per_device_measured": eff.tflops_per_device_measured,
            "mean_active_experts": eff.mean_active_experts,
            "peak_memory_gib": None if eff.peak_memory_bytes is None else eff.peak_memory_bytes / 2**30,
            "backend": eff.backend,
            "wall_s": round(wall_s[run.label], 1),
            "record": str(plan.run_dir(run) / "record.json"),
            "trace": trace_figures(plan.run_dir(run)),
            "device_time_ms": {"median": statistics.median(devices_ms)} if devices_ms else None,
            "interleaved": ratios.get(run.label),
            "ratio_to_switch": 1.0 if run.label == REFERENCE_ROUTER and ratios else (
                ratios[run.label]["ratio"] if run.label in ratios else None),
        }
    environment = next((records[r.label].environment for r in plan.runs if r.label in records), None)
    config = plan.run(plan.runs[0]).config()
    batch, seq = config.data.global_batch_size, config.seq_length
    return {
        "command": shlex.join(["python", "-m", "repro", "study", "efficiency", *argv]),
        "flavour": plan.flavour,
        "devices": plan.devices,
        **{key: getattr(environment, key, None) for key in ("device", "torch", "megatron_core")},
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
        "interleaved": plan.interleave,
        "runs": runs,
        "dirmoe_over_switch": runs.get("dirmoe", {}).get("ratio_to_switch"),
        "published_dirmoe_over_switch": PUBLISHED_MS["dirmoe"] / PUBLISHED_MS["switch"],
        "failed": sorted(errors),
        "stopped_after": stopped_after,
    }


def _command_table(plan: Any, records: list, summary: dict[str, Any], ledger=None):
    """The finished runs' :func:`~repro.report.tables.efficiency_table` (with ``ledger``'s rows), its caption
    giving tokens per iteration and start steps."""
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
    if ledger is not None and plan.flavour == "185m":
        extra += " The papers' rows: 512 x 1024 tokens per iteration on 8 GPUs (64 sequences per GPU)."
    return dataclasses.replace(table, caption=table.caption + extra)


def _summary_text(summary: dict[str, Any]) -> str:
    """The summary's iteration times as lines of text (what the command prints)."""
    lines = [
        f"Iteration time (ms) over {summary['measured_iterations']} iterations after {summary['warmup_iterations']} "
        f"warm-up, {summary['devices']} x {summary['device']}, {summary['tokens_per_iteration']:,} tokens per iteration, "
        f"from {summary['timed_from']}:"
    ]
    if summary.get("stopped_after") is not None:
        lines.append(f"  stopped by a signal after step {summary['stopped_after']}: every run measured that far")
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
    plan: Any, records: dict[str, Any], errors: dict[str, str], wall_s: dict[str, float], argv: list[str],
    stopped_after: int | None = None,
) -> None:
    """Write and print the command's outputs in ``plan.out_dir``: the table in ``plan.formats`` and ``summary.json``.

    Args:
        plan: the command's :class:`repro.studies.efficiency.EfficiencyPlan`.
        records: the finished runs' records, by run label.
        errors: the failed runs' one-line errors, by run label.
        wall_s: each run's wall time, by run label.
        argv: the command's arguments.
        stopped_after: the steps run when a stop signal ended the measurement early (None: all of them).
    """
    from repro.io_utils import write_json_atomic
    from repro.report.published import load_ledger
    from repro.report.table_core import render, write_tables

    summary = _command_summary(plan, records, errors, wall_s, argv, stopped_after)
    measured = [records[r.label] for r in plan.runs if r.label in records]
    if measured:
        table = _command_table(plan, measured, summary, ledger=load_ledger() if plan.published else None)
        for path in write_tables([table], plan.out_dir, plan.formats):
            print(f"wrote {path}")
        print("\n" + render(table, "md"))
    write_json_atomic(Path(plan.out_dir) / "summary.json", summary)
    print(_summary_text(summary))
    print(f"wrote {Path(plan.out_dir) / 'summary.json'}")

