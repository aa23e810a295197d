"""Assemble ``results/<device>/`` from the archives ``benchmarks/gpu_measure.sh`` wrote on a GPU machine.

    python benchmarks/gpu_collect.py --out results/h200 CALL [CALL ...]

Each CALL is one call of the script: the folder its ``$OUT`` came back as (``gpu.tgz`` inside), or the ``gpu.tgz``
itself. Writes ``OUT/call<N>/``, the archive's files as the call left them (``environment.txt``, ``phases.txt``,
``pytest.log``, and each efficiency phase's folder as ``python -m repro study efficiency`` wrote it:
``summary.json``, the tables, ``runs/<run>/`` with each run's config, log, record and traced step's summary), and
``OUT/README.md``, generated from those files alone: per call the machine, the GPU tests' outcome, and per phase
each run's iteration time, TFLOP/s, active experts per token (over the timed steps that logged routing), the
device-busy share of its traced step and its ratio to Switch with the 95% interval and the change the rounds detect
with 80% power, then the phase read against :data:`GOALS`. ``OUT`` must not exist; a call whose archive is missing
or unreadable is one line naming it, and nothing is left behind. (``results/h100/`` was assembled by an earlier
version of this script, from that script's earlier archive layout.)
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from tabulate import tabulate

#: The efficiency phases of gpu_measure.sh, in the order it runs them.
PHASES = ("interleave", "levers", "routers")
#: What a call is read against (docs/efficiency.md, "Measured on an H100"): DirMoE's step time over Switch's
#: stepped in turn (the DirMoE paper's is 1.013 on 8 GPUs) and that interval's relative half-width; Switch's
#: TFLOP/s per device (the papers' 138 on 8 GPUs) and device-busy share of its traced step; DirMoE's routers
#: against Switch's per call (device time, launches).
GOALS = {"ratio": 1.01, "half_width": 0.01, "tflops": 200.0, "tflops_stretch": 250.0, "busy": 0.90,
         "router_per_call": 1.3}


def environment(path: Path) -> dict[str, str]:
    """The facts of a call's ``environment.txt``: started, commit, device, software and the measured bf16 peak
    (absent where the line is)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    out = {"started": lines[0] if lines else "", "commit": lines[1][:10] if len(lines) > 1 else ""}
    for line in lines:
        if line.startswith("device "):
            out["device"] = line.removeprefix("device ")
        elif line.startswith("python "):
            out["software"] = line
        elif line.startswith("megatron-core "):
            out["software"] = f"{out.get('software', '')}; {line}"
        elif line.startswith("bf16 matmul"):
            out["bf16 peak"] = line.split(": ", 1)[-1]
        elif line.startswith("boot id "):
            out["boot id"] = line.removeprefix("boot id ")[:8]
    return out


def pytest_outcome(path: Path) -> tuple[str, list[str]]:
    """pytest's closing count line and the ids of the tests that failed or errored ("" and [] without a log)."""
    if not path.is_file():
        return "", []
    text = path.read_text()
    counts = [line.strip("= ") for line in text.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)))
    return (counts[-1] if counts else "no count line (cut short?)"), failed


def _ratio(figures: dict[str, Any] | None) -> str:
    if not figures:
        return "--"
    return (f"{figures['ratio']:.3f} [{figures['low']:.3f}, {figures['high']:.3f}], "
            f"detects {figures['detectable']:.1%} ({figures['rounds']} rounds)")


def phase_table(summary: dict[str, Any]) -> str:
    """A phase's runs as a Markdown table, from its ``summary.json``."""
    rows = []
    for label, run in summary["runs"].items():
        if "error" in run:
            rows.append((label, f"FAILED: {run['error']}", "", "", "", "", "", ""))
            continue
        t, trace = run["iter_time_ms"], run.get("trace") or {}
        busy = trace.get("busy_share")
        rows.append((
            label,
            f"{t['median']:.1f} ({t['min']:.0f}-{t['max']:.0f})",
            f"{run['tflops_per_device_analytic']:.3g}",
            "--" if run.get("mean_active_experts") is None else f"{run['mean_active_experts']:.2f}",
            "--" if busy is None else f"{busy:.0%} of {trace['span_ms']:.0f} ms, {trace['launches']} launches",
            "--" if run.get("peak_memory_gib") is None else f"{run['peak_memory_gib']:.1f}",
            "1 (reference)" if run.get("ratio_to_switch") == 1.0 and not run.get("interleaved")
            else _ratio(run.get("interleaved")),
            _ratio((run.get("interleaved") or {}).get("device")),
        ))
    headers = ("run", "ms/iter, median (min-max)", "TFLOP/s per device", "active experts", "traced step: device busy",
               "peak GiB", "/ switch, wall [95% CI]", "/ switch, device time [95% CI]")
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)  # digits as formatted


def _per_call(run: dict[str, Any]) -> tuple[float, float] | None:
    """A run's routers in its traced step: device ms and launches per router call (None: no CUDA trace)."""
    t = run.get("trace") or {}
    if not t.get("router_calls") or t.get("router_device_ms") is None:
        return None
    return t["router_device_ms"] / t["router_calls"], t["router_launches"] / t["router_calls"]


def goal_lines(summary: dict[str, Any]) -> list[str]:
    """A phase's runs read against :data:`GOALS`, each line with what it rests on (an interval, a median, one
    traced step); a run without the figure a goal needs has no line for it."""
    runs = {label: run for label, run in summary["runs"].items() if "error" not in run}
    lines = []
    if (dirmoe := (runs.get("dirmoe") or {}).get("interleaved")) is not None:
        goal, width = GOALS["ratio"], GOALS["half_width"]
        verdict = ("met: the whole interval is at or below it" if dirmoe["high"] <= goal else
                   "not met: the whole interval is above it" if dirmoe["low"] > goal else
                   "undecided: the interval holds it")
        lines.append(f"dirmoe / switch, wall: {dirmoe['ratio']:.3f} [{dirmoe['low']:.3f}, {dirmoe['high']:.3f}] "
                     f"(goal <= {goal}: {verdict}); half-width {dirmoe['half_width']:.2%} (goal <= {width:.0%}: "
                     f"{'met' if dirmoe['half_width'] <= width else 'not met'}), {dirmoe['rounds']} rounds.")
    for label, run in runs.items():
        if not label.startswith("switch"):
            continue
        tflops, busy = run["tflops_per_device_analytic"], (run.get("trace") or {}).get("busy_share")
        reached = ("stretch reached" if tflops >= GOALS["tflops_stretch"] else
                   "reached" if tflops >= GOALS["tflops"] else "below")
        steps = run.get("iterations", summary["measured_iterations"])
        line = (f"{label}: {tflops:.3g} TFLOP/s per device at the median of {steps} steps "
                f"(goal >= {GOALS['tflops']:.0f}, stretch {GOALS['tflops_stretch']:.0f}: {reached})")
        if busy is not None:
            line += (f"; device busy {busy:.0%} of its traced step (goal >= {GOALS['busy']:.0%}: "
                     f"{'reached' if busy >= GOALS['busy'] else 'below'})")
        lines.append(line + ".")
    for label, run in runs.items():
        if not label.startswith("dirmoe"):
            continue
        partner = runs.get("switch" + label.removeprefix("dirmoe")) or runs.get("switch") or {}
        if (ours := _per_call(run)) is None or (theirs := _per_call(partner)) is None:
            continue
        within = GOALS["router_per_call"]
        parts = [f"{what} {a:.3g} against {b:.3g} ({a / b:.2f}x: {'within' if a / b <= within else 'above'} "
                 f"{within}x)" for what, a, b in (("device ms", ours[0], theirs[0]), ("launches", ours[1], theirs[1]))]
        lines.append(f"{label}'s routers per call, one traced step each (no interval): {'; '.join(parts)}.")
    return lines


def readme(folder: Path, calls: int, out: Path) -> str:
    """``OUT/README.md`` from the files under ``folder/call<N>/`` (``folder`` becomes ``out``)."""
    parts = ["# Efficiency, traces and GPU tests on one GPU", "",
             "<!-- generated by benchmarks/gpu_collect.py from the files below; do not edit -->", "",
             f"Assembled by `python benchmarks/gpu_collect.py --out {out.as_posix()} ...` from {calls} call(s) of "
             "`benchmarks/gpu_measure.sh` (docs/efficiency.md, \"Measured on an H100\"). Ratios are formed only "
             "between runs stepped in turn in one process (`python -m repro study efficiency`'s default on one "
             "device); the interval is by batch means over the rounds (`repro.stats.timing_ratio`)."]
    for n in range(1, calls + 1):
        call = folder / f"call{n}"
        env = environment(call / "environment.txt")
        parts += ["", f"## Call {n}", ""]
        parts += [f"- {key}: {value}" for key, value in env.items() if value]
        phases = (call / "phases.txt").read_text().split("\n") if (call / "phases.txt").is_file() else []
        parts.append(f"- phases: {'; '.join(p for p in phases if p) or 'none recorded'}")
        counts, failed = pytest_outcome(call / "pytest.log")
        if counts:
            parts.append(f"- GPU tests: {counts}" + (f"; failed: {', '.join(failed)}" if failed else ""))
        for phase in PHASES:
            path = call / phase / "summary.json"
            if not path.is_file():
                continue
            summary = json.loads(path.read_text())
            parts += ["", f"### {phase}", "",
                      f"`{summary['command']}`: {summary['devices']} x {summary['device']}, "
                      f"{summary['tokens_per_iteration']:,} tokens per iteration (micro-batch "
                      f"{summary['micro_batch_size']} x {summary['accumulation']}), {summary['measured_iterations']} "
                      f"iterations after {summary['warmup_iterations']} warm-up, from {summary['timed_from']}.", "",
                      phase_table(summary)]
            if summary.get("stopped_after") is not None:
                parts.append(f"\nStopped by its time limit after step {summary['stopped_after']}: every run measured "
                             "that far (the iterations behind each median are in `summary.json`).")
            if goals := goal_lines(summary):
                parts += ["", "Read against the goals:", "", *(f"- {line}" for line in goals)]
            if summary.get("failed"):
                parts.append(f"\nFailed: {', '.join(summary['failed'])}.")
    return "\n".join(parts) + "\n"


def _unpack(call: Path, dest: Path) -> None:
    archive = call / "gpu.tgz" if call.is_dir() else call
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    except (OSError, tarfile.TarError) as exc:
        raise SystemExit(f"error: {archive}: not a readable gpu_measure.sh archive ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the folder to create (results/<device>)")
    p.add_argument("calls", nargs="+", help="each call's returned folder (or its gpu.tgz), in call order")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"error: {out} exists: choose a new --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside OUT and renamed at the end: a bad archive leaves nothing behind.
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as tmp:
        stage = Path(tmp) / out.name
        for n, call in enumerate(args.calls, 1):
            _unpack(Path(call), stage / f"call{n}")
        (stage / "README.md").write_text(readme(stage, len(args.calls), out))
        shutil.move(str(stage), out)
    print(f"wrote {out}/README.md and {len(args.calls)} call folder(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
