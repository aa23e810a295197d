"""Assemble ``results/h100/`` from the archives that ``benchmarks/gpu_measure.sh`` wrote on GPU machines.

    python benchmarks/gpu_collect.py --out results/h100 CALL1.tgz CALL2.tgz ...

Each archive is one call (one command; a call that found the machine of the call before still warm ran on it:
``environment.txt``'s boot id says which). For every efficiency run label the latest call that finished it wins;
a run stopped by its phase's time limit keeps the iterations it logged (its record says how many) when no call
finished it. The environment of a record made here is copied from a record of the same call (the GPU machine's,
not this one's). The trace summaries are computed again from the Chrome traces (``trace-<router>.json.gz``
beside each archive) by the current :func:`repro.training.trace.summarize`; where only a summary was kept
(``trace-<router>.json`` beside the archive), it is copied, and so is any ``*.log`` beside the archive (what
the call's command wrote besides the script's archive, a diagnostic's output say).

Writes ``OUT/efficiency/`` where the calls ran the efficiency phase (runs, ``efficiency.md|csv|tex``,
``summary.json`` with each run's call); ``OUT/call<N>/``: each call's ``environment.txt``, ``phases.txt`` and
``pytest.log``, per traced router ``trace-<router>.json`` (the summary) and ``trace-<router>.log.jsonl`` (that
run's log), per repeated run ``repeat<i>-<router>.log.jsonl`` and each repeat's ``repeat<i>-summary.json``;
``OUT/by_call.md`` (iteration times and ratios within each call and repeat) and ``OUT/README.md`` (generated
from all of these). Prints what came from where. ``OUT`` must not exist.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from repro.records.step_log import read_rows, timed_rows
from repro.records.store import load_record, record_from_run_dir, write_record
from repro.studies.efficiency import EfficiencyPlan, RunSpec, _variant
from repro.studies.efficiency_report import write_command_outputs
from repro.training.trace import summarize

#: The command each call ran (benchmarks/gpu_measure.sh's efficiency phase; the router list was cut for calls
#: after the first, to the runs still missing).
VARIANTS = ("dirmoe-eager=dirmoe,router.options.compile_elementwise=never", "switch-local=switch,model.backend=local",
            "dirmoe-local=dirmoe,model.backend=local")
ROUTERS = ("auxfree", "dirmoe", "expert_choice", "hash", "lory", "remoe", "sparsemixer", "switch", "dense")
WARMUP, ITERS = 3, 10


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("archives", nargs="+")
    args = p.parse_args()
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists: choose a new --out")
    out.mkdir(parents=True)
    eff = out / "efficiency"
    found: dict[str, tuple[int, Path, bool]] = {}  # label -> (call, run dir, finished)
    by_call: list[tuple[int, str, list[float]]] = []
    repeat_tflops: dict[tuple[int, str], float] = {}  # (call, "router #i") -> TFLOP/s per device
    with tempfile.TemporaryDirectory() as tmp:
        for call, archive in enumerate(args.archives, 1):
            where = Path(tmp) / f"call{call}"
            with tarfile.open(archive) as tar:
                tar.extractall(where, filter="data")
            keep = out / f"call{call}"
            keep.mkdir()
            for name in ("environment.txt", "phases.txt", "pytest.log"):
                if (where / name).is_file():
                    shutil.copy(where / name, keep / name)
            for log in Path(archive).parent.glob("*.log"):  # what the call's command wrote beside the archive
                shutil.copy(log, keep / log.name)
            for log in sorted(where.glob("repeat*/runs/*/log.jsonl"), key=lambda q: (_repeat(q), q.parent.name)):
                label = f"{log.parent.name} #{_repeat(log)}"
                by_call.append((call, label, _timed_ms(log)))
                shutil.copy(log, keep / f"repeat{_repeat(log)}-{log.parent.name}.log.jsonl")
            for repeat in sorted(where.glob("repeat*/summary.json")):
                shutil.copy(repeat, keep / f"{repeat.parent.name}-summary.json")
                for router, entry in json.loads(repeat.read_text())["runs"].items():
                    if entry.get("tflops_per_device_analytic") is not None:
                        label = f"{router} #{repeat.parent.name.removeprefix('repeat')}"
                        repeat_tflops[call, label] = entry["tflops_per_device_analytic"]
            for log in sorted(where.glob("trace/runs/*/log.jsonl")):
                shutil.copy(log, keep / f"trace-{log.parent.name}.log.jsonl")
            for trace in sorted(Path(archive).parent.glob("trace-*.json.gz")):  # gpu_measure.sh puts them beside
                with gzip.open(trace, "rt") as f:
                    summary = summarize(json.load(f))
                on_device = json.loads((where / "trace" / "runs" / trace.name[6:-8] / "trace" / "summary.json").read_text())
                summary = {"step": on_device["step"], "step_time_s": on_device["step_time_s"], **summary}
                (keep / trace.name.replace(".json.gz", ".json")).write_text(json.dumps(summary, indent=1) + "\n")
            for kept in sorted(Path(archive).parent.glob("trace-*.json")):  # a summary without its Chrome trace
                if not kept.with_suffix(".json.gz").exists():
                    shutil.copy(kept, keep / kept.name)
            for run_dir in sorted((where / "efficiency" / "runs").glob("*/")):
                if not (run_dir / "log.jsonl").is_file():
                    continue
                by_call.append((call, run_dir.name, _timed_ms(run_dir / "log.jsonl")))
                finished = (run_dir / "record.json").is_file()
                if finished or run_dir.name not in found or not found[run_dir.name][2]:
                    found[run_dir.name] = (call, run_dir, finished)  # in the temporary folder until copied below
        records, calls, wall = {}, {}, {}
        if found:
            (eff / "runs").mkdir(parents=True)
            (eff / ".efficiency-out").touch()
        for label, (call, run_dir, finished) in sorted(found.items()):
            dest = eff / "runs" / label
            shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns(".lock"))
            if not finished:
                sibling = next(c / "record.json" for (k, c, f) in found.values() if k == call and f)
                environment = load_record(sibling).environment
                spec = _spec(label)
                write_record(record_from_run_dir(dest, warmup=WARMUP, run_id=label, environment=environment,
                                                 start_step=spec.start_step), dest / "record.json")
            records[label] = load_record(dest / "record.json")
            calls[label] = call
            rows = read_rows(dest)
            wall[label] = sum(r.iter_time_s for r in rows)
            print(f"{label:16s} call {call} {'finished' if finished else f'stopped after {len(rows)} iterations'}")
    (out / "by_call.md").write_text(_by_call_table(by_call))
    summary = _write_efficiency(out, eff, records, calls, wall, len(args.archives)) if records else None
    (out / "README.md").write_text(_readme(out, len(args.archives), summary, by_call, repeat_tflops))
    return 0


def _write_efficiency(out: Path, eff: Path, records: dict, calls: dict, wall: dict, n_calls: int) -> dict:
    """The efficiency command's outputs for the runs found (``OUT/efficiency/``); returns its summary."""
    runs = tuple(_spec(label) for label in [*ROUTERS, *(v.split("=")[0] for v in VARIANTS)] if label in records)
    plan = EfficiencyPlan(runs=runs, flavour="llama-185m", devices=1, accumulation=4, warmup=WARMUP, iters=ITERS,
                          vocab_size=50257, overrides=(), out_dir=str(eff), published=True)
    argv = ["--published", "--iters", str(ITERS), *(a for v in VARIANTS for a in ("--variant", v))]
    write_command_outputs(plan, records, {}, wall, argv)
    summary_path = eff / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["assembled_by"] = "python benchmarks/gpu_collect.py --out " + str(out) + " " + " ".join(
        f"call{i}.tgz" for i in range(1, n_calls + 1))
    for label, entry in summary["runs"].items():
        entry["call"] = calls[label]
    # The command's DirMoE / Switch ratio would mix machines here: by_call.md has the ratios within each call.
    summary["dirmoe_over_switch"] = None
    summary["note"] = "runs of several calls (machines); compare within a call: ../by_call.md"
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _environment(path: Path) -> dict[str, str]:
    """The facts gpu_measure.sh wrote into a call's environment.txt."""
    lines = path.read_text().splitlines() if path.is_file() else []
    get = lambda prefix: next((line for line in lines if line.startswith(prefix)), "")  # noqa: E731
    gpu = next((line for line in lines if line.startswith("NVIDIA")), "")
    return {"when": lines[0] if lines else "", "commit": lines[1][:7] if len(lines) > 1 else "", "gpu": gpu,
            "software": f"{get('python ')}; {get('megatron-core ')}", "matmul": get("bf16 matmul"),
            "machine": get("boot id ").removeprefix("boot id ")[:8] or "--"}


def _pytest_outcome(path: Path) -> tuple[str, list[str]]:
    """A pytest log's last summary line and its failures' first assertion lines."""
    import re

    if not path.is_file():
        return "not run", []
    text = path.read_text()
    last = next((line.strip("= ") for line in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "?")
    failures = []
    for block in re.split(r"\n_{3,} (test_\S+(?: \S+)?) _{3,}\n", text)[1:]:
        if block.startswith("test_"):
            failures.append(block)
        elif failures:
            first_e = next((line[1:].strip() for line in block.splitlines() if line.startswith("E ")), "")
            failures[-1] = f"`{failures[-1]}`: {first_e[:300]}"
    return last, failures


def _readme(out: Path, calls: int, summary: dict | None, by_call: list[tuple[int, str, list[float]]],
            repeat_tflops: dict[tuple[int, str], float]) -> str:
    """results/h100/README.md, every number read from the files beside it."""
    import statistics

    runs = summary["runs"] if summary else {}
    lines = [
        "# LLaMA-185M on one H100: efficiency, traces and the GPU tests",
        "",
        "Written by `benchmarks/gpu_collect.py` from the archives `benchmarks/gpu_measure.sh` wrote on the GPU "
        "machine, one archive per call (one command; a call that found the machine of the call before it "
        "still warm ran on that machine). Do not edit: run the two scripts again (docs/efficiency.md, "
        "\"Measured on an H100\").",
        "",
        "| call | started (UTC) | machine (boot id) | commit | GPU, driver, memory, max SM clock | software | measured bf16 peak |",
        "|---|---|---|---|---|---|---|",
    ]
    envs = {c: _environment(out / f"call{c}" / "environment.txt") for c in range(1, calls + 1)}
    for c, env in envs.items():
        lines.append(f"| {c} | {env['when']} | {env['machine']} | {env['commit']} | {env['gpu']} | {env['software']} | {env['matmul']} |")
    setting = ("LLaMA-185M, E=8, k=1, bf16, micro-batches of 16 x 1024 tokens x 4 accumulation steps per iteration "
               f"({4 * 16 * 1024:,} tokens), synthetic tokens, {WARMUP} warm-up iterations, from initialisation")
    where = (f"`efficiency/` holds the table ([efficiency.md](efficiency/efficiency.md)), the run records and "
             f"`summary.json` (each run's `call`): {setting}, {ITERS} iterations measured. A run of a call that hit "
             "its time limit keeps the iterations it logged." if summary else
             f"{setting}; each repeat (`call<N>/repeat<i>-*`) is one `python -m repro study efficiency --router "
             "switch,dirmoe --iters 20`.")
    lines += [
        "",
        "## Iteration time",
        "",
        where + " Ratios below compare runs of the same call and repeat only:",
        "",
        (out / "by_call.md").read_text().split("\n\n", 1)[1].strip(),
        "",
    ]
    switch = {call: statistics.median(t) for call, label, t in by_call if label == "switch" and t}
    medians = {(call, label): statistics.median(t) for call, label, t in by_call if t}
    tf = runs.get("switch", {}).get("tflops_per_device_analytic")
    peaks = [float(e["matmul"].split(":")[1].split()[0]) for e in envs.values() if e["matmul"]]
    targets = []
    for call, label in sorted(medians):
        if label in ("dirmoe", "dirmoe-eager") and call in switch:
            ratio = medians[call, label] / switch[call]
            targets.append(f"- {label} / Switch, call {call}: **{ratio:.3f}** (target <= 1.01: "
                           f"{'met' if ratio <= 1.01 else 'not met'}; the DirMoE paper: 1.013).")
    if tf is not None:
        targets.append(f"- Switch, TFLOP/s per GPU (Megatron-LM's count, causal attention halved): **{tf:.1f}** "
                       f"(target >= 138, the paper's per-GPU figure on 8 GPUs: {'met' if tf >= 138 else 'not met'}); "
                       + (f"{100 * tf / statistics.fmean(peaks):.1f}% of the measured bf16 matmul peak "
                          f"({statistics.fmean(peaks):.0f} TFLOP/s)." if peaks else ""))
    for a, b in (("switch", "switch-local"), ("dirmoe-eager", "dirmoe-local")):
        same = [c for c in switch if (c, a) in medians and (c, b) in medians]
        for c in same:
            targets.append(f"- {b} / {a}, call {c}: {medians[c, b] / medians[c, a]:.2f}x the time "
                           f"({medians[c, b]:.0f} against {medians[c, a]:.0f} ms).")
    for call in sorted({c for c, _ in medians}):
        names = sorted({label.split(" ")[0] for c, label in medians if c == call and " #" in label} - {"switch"})
        for name in names:
            ratios = [medians[call, label] / medians[call, _reference(label)] for c, label in sorted(medians)
                      if c == call and label.startswith(name + " #") and (call, _reference(label)) in medians]
            if len(ratios) >= 2:
                targets.append(f"- {name} / Switch over {len(ratios)} repeats, call {call}: "
                               + ", ".join(f"{r:.3f}" for r in ratios)
                               + f"; mean {statistics.fmean(ratios):.3f}, sd {statistics.stdev(ratios):.3f}.")
        for name in sorted({label.split(" ")[0] for c, label in repeat_tflops if c == call}):
            tflops = [t for (c, label), t in sorted(repeat_tflops.items()) if c == call and label.split(" ")[0] == name]
            peak = (f" ({100 * statistics.fmean(tflops) / statistics.fmean(peaks):.1f}% of the measured bf16 matmul "
                    "peak)" if peaks else "")
            targets.append(f"- {name}, TFLOP/s per GPU over the repeats of call {call}: "
                           + ", ".join(f"{t:.1f}" for t in tflops) + f"; mean {statistics.fmean(tflops):.1f}{peak}"
                           + (" (target >= 138: " + ("met" if statistics.fmean(tflops) >= 138 else "not met") + ")"
                              if name == "switch" else "") + ".")
    lines += ["Targets and the backends' gain:", "", *targets, ""]
    traces = sorted(p for p in out.glob("call*/trace-*.json"))
    if traces:
        lines += [
            "## Where a step's time goes (torch profiler, one step each)",
            "",
            "`python -m repro study efficiency --router switch,dirmoe --warmup 3 --iters 2 --set logging.trace_step=5`: "
            "step 5 (no routing metrics) recorded by `repro/training/trace.py`; figures recomputed from the "
            "Chrome traces by its `summarize`. The profiler slows the host side of the step it records.",
            "",
            "| call | router | step (ms, profiled) | device busy (ms) | busy / the call's unprofiled median (of its repeats where it has no single run) | launches | router fwd + bwd on the device (ms) | router share of device time | host time in router forwards (ms) | launches from the routers |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        tops = []
        for path in traces:
            t = json.loads(path.read_text())
            call, router = int(path.parent.name[4:]), path.stem[6:]
            repeats = [m for (c, label), m in medians.items() if c == call and label.startswith(router + " #")]
            median = medians.get((call, router)) or (statistics.median(repeats) if repeats else None)
            busy_ms = t["busy_us"] / 1e3
            busy = f"{busy_ms / median:.0%} of {median:.0f} ms" if median else "--"
            lines.append(
                f"| {call} | {router} | {t['step_time_s'] * 1e3:.0f} | {busy_ms:.0f} | {busy} | {t['launches']:,} | "
                f"{t['router_forward_us'] / 1e3:.1f} + {t['router_backward_us'] / 1e3:.1f} | {t['router_share']:.1%} | "
                f"{t['router_host_us'] / 1e3:.1f} | {t['router_launches']:,} |")
            tops.append(f"- {router} (call {call}): " + "; ".join(
                f"{k['name'][:60]} {k['us'] / 1e3:.1f} ms x{k['calls']}" for k in t["top"][:5]))
        lines += ["", "Top kernels by device time:", "", *tops, ""]
    lines += ["## GPU tests (`pytest -m gpu tests/test_gpu.py`)", ""]
    for c in range(1, calls + 1):
        last, failures = _pytest_outcome(out / f"call{c}" / "pytest.log")
        lines.append(f"- call {c}: {last}" + ("" if not failures else "; failed:"))
        lines += [f"  - {f}" for f in failures]
    return "\n".join(lines) + "\n"


def _repeat(log: Path) -> int:
    """The index of the repeat a run's log belongs to (``repeat3/runs/<run>/log.jsonl`` -> 3)."""
    return int(log.parent.parent.parent.name.removeprefix("repeat"))


def _reference(label: str) -> str:
    """The Switch run a run is compared with: of the same repeat (``dirmoe #2`` -> ``switch #2``)."""
    name, _, repeat = label.partition(" ")
    return f"switch {repeat}" if repeat else "switch"


def _timed_ms(log: Path) -> list[float]:
    """The iteration times (ms) the efficiency table's median is taken over: after the warm-up, without the rows
    that computed routing metrics."""
    return [r.iter_time_s * 1e3 for r in timed_rows(read_rows(log)[WARMUP:])]


def _by_call_table(by_call: list[tuple[int, str, list[float]]]) -> str:
    """Markdown: every run each call logged (finished or not; ``run #i``: repeat i), its iteration times and its
    ratio to the Switch run of the same call (the same machine) and repeat, so ratios never mix machines."""
    import statistics

    from tabulate import tabulate

    medians = {(call, label): statistics.median(t) for call, label, t in by_call if t}
    rows = []
    # each call's runs, then its repeats in order
    for call, label, times in sorted(by_call, key=lambda r: (r[0], " #" in r[1], r[1].partition(" #")[2].zfill(4))):
        if not times:
            continue
        median, reference = medians[call, label], medians.get((call, _reference(label)))
        ratio = f"{median / reference:.3f}" if reference else "--"
        rows.append((call, label, len(times), f"{min(times):.1f}", f"{median:.1f}", f"{max(times):.1f}", ratio))
    head = ("call", "run", "iterations", "min ms", "median ms", "max ms", "median / Switch of the same call (and repeat)")
    return ("Iteration times per call (one machine each), from each run's log.jsonl: the iterations after the "
            f"{WARMUP} warm-up ones, without the two that computed routing metrics; written by "
            "benchmarks/gpu_collect.py.\n\n" + tabulate(rows, head, tablefmt="github") + "\n")


def _spec(label: str) -> RunSpec:
    variant = next((v for v in VARIANTS if v.split("=")[0] == label), None)
    return _variant(variant) if variant else RunSpec(label, label)


if __name__ == "__main__":
    raise SystemExit(main())
