"""A torch profiler trace of one training step and where its device time goes (``logging.trace_step=N``; files
and use: docs/efficiency.md, "The step trace"). Without CUDA the figures are host time of outermost ops
(``"clock": "cpu"``). Profiling slows the step: take timings from other runs.
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from repro.io_utils import atomic_path, write_json_atomic

if TYPE_CHECKING:
    from repro.records.step_log import LogRow
    from repro.training.components import TrainerState

ROUTER_RANGE = "repro::router"
_BACKWARD_PREFIX = "autograd::engine::evaluate_function:"
TOP_KERNELS = 20


class StepTrace:
    """Trainer component: profile step ``step`` (>= 2) on the main rank into ``out_dir``."""

    def __init__(self, out_dir: Path, step: int, is_main: bool) -> None:
        self.out_dir, self.step, self.is_main = Path(out_dir), step, is_main
        self.profiler: torch.profiler.profile | None = None
        self._hooks: list[Any] = []
        self._open: list[Any] = []

    def after_step(self, trainer: TrainerState, row: LogRow) -> LogRow:
        if not self.is_main:
            return row
        if row.step == self.step - 1:
            self.start(trainer.model)
        elif row.step == self.step and self.profiler is not None:
            self.stop(row.iter_time_s)
        return row

    def start(self, model: torch.nn.Module) -> None:
        """Record ``model`` until :meth:`stop` (called by ``after_step`` or :mod:`repro.training.interleave`)."""
        from routers.megatron_adapter import router_adapters

        for adapter in router_adapters(model):
            self._hooks += [adapter.register_forward_pre_hook(self._enter), adapter.register_forward_hook(self._exit)]
        kinds = torch.profiler.ProfilerActivity
        activities = [kinds.CPU, kinds.CUDA] if torch.cuda.is_available() else [kinds.CPU]
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()

    def _enter(self, module, args) -> None:
        rf = torch.autograd.profiler.record_function(ROUTER_RANGE)
        rf.__enter__()
        self._open.append(rf)

    def _exit(self, module, args, output) -> None:
        self._open.pop().__exit__(None, None, None)

    def _end(self) -> torch.profiler.profile | None:
        """Stop the profiler (returned; None if not recording) and remove the router hooks."""
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.__exit__(None, None, None)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return profiler

    def stop(self, step_time_s: float) -> None:
        """Stop recording; write the trace and its summary (``step_time_s``: the recorded step's time)."""
        profiler = self._end()
        # atomic_path: the raw export sits in its temporary folder, so a full disk leaves no partial file
        with atomic_path(self.out_dir / "trace.json.gz") as packed:
            raw = packed.with_suffix("")
            profiler.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(packed, "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace = json.loads(raw.read_text())
        summary = {"step": self.step, "step_time_s": step_time_s, **summarize(trace)}
        write_json_atomic(self.out_dir / "summary.json", summary)

    def close(self) -> None:
        self._end()  # the run ended before the traced step: record nothing


def _outermost(events: list[dict]) -> list[dict]:
    """The events (of one thread) not inside another."""
    out, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def _union_us(spans: list[tuple[float, float]]) -> float:
    merged: list[list[float]] = []
    for t0, t1 in sorted(spans):
        if merged and t0 <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t1)
        else:
            merged.append([t0, t1])
    return sum((t1 - t0 for t0, t1 in merged), 0.0)


def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    """Where a step's time goes, from its Chrome trace. Device work is tied to its launch by ``correlation``: router
    forward if launched in a ``repro::router`` range, backward if in an ``autograd::engine::evaluate_function``
    whose ``Sequence number`` matches an op in such a range.

    Args:
        trace: parsed Chrome trace of one step, router calls in ``repro::router`` ranges.

    Returns:
        ``clock`` ("cuda" or "cpu"), ``span_us``, ``total_us`` (all device work, or outermost ops on cpu),
        ``busy_us`` (overlaps once), ``launches``, ``top`` (:data:`TOP_KERNELS` by time), ``router_calls``,
        ``router_host_us``, ``router_{forward,backward}_us``, ``router_launches``, ``router_share`` (of ``total_us``).
    """
    import bisect

    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    launch_events = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                     and "correlation" in e.get("args", {}) and "Launch" in e.get("name", "")]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == ROUTER_RANGE]

    def intervals(evs) -> dict[Any, tuple[list[float], list[float]]]:
        by_tid: dict[Any, list[tuple[float, float]]] = defaultdict(list)
        for e in evs:
            by_tid[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
        return {tid: tuple(map(list, zip(*sorted(v)))) for tid, v in by_tid.items()}

    def inside(index, tid, ts) -> bool:
        starts, ends = index.get(tid, ((), ()))
        i = bisect.bisect_right(starts, ts) - 1
        return i >= 0 and ts <= ends[i]

    forward_index = intervals(ranges)
    seqs = {e["args"]["Sequence number"] for e in ops
            if "Sequence number" in e.get("args", {}) and inside(forward_index, e["tid"], e["ts"])}
    backward = [e for e in ops if e["name"].startswith(_BACKWARD_PREFIX) and e.get("args", {}).get("Sequence number") in seqs]
    backward = _outermost(backward)
    backward_index = intervals(backward)
    start = min((e["ts"] for e in ops), default=0.0)
    end = max((e["ts"] + e["dur"] for e in events), default=0.0)
    summary: dict[str, Any] = {
        "span_us": end - start, "router_calls": len(ranges), "router_host_us": sum(e["dur"] for e in ranges),
    }
    if device:
        launched = {e["args"]["correlation"]: (e["tid"], e["ts"]) for e in launch_events}
        fwd, bwd, n_router = 0.0, 0.0, 0
        for e in device:
            tid_ts = launched.get(e.get("args", {}).get("correlation"))
            if tid_ts is None:
                continue
            if inside(forward_index, *tid_ts):
                fwd, n_router = fwd + e["dur"], n_router + 1
            elif inside(backward_index, *tid_ts):
                bwd, n_router = bwd + e["dur"], n_router + 1
        timed = device
        summary.update(clock="cuda", busy_us=_union_us([(e["ts"], e["ts"] + e["dur"]) for e in device]),
                       launches=len(launch_events), router_launches=n_router)
    else:
        tids = dict.fromkeys(e["tid"] for e in ops)
        timed = [e for tid in tids for e in _outermost([o for o in ops if o["tid"] == tid])]
        fwd, bwd = sum(e["dur"] for e in ranges), sum(e["dur"] for e in backward)
        summary.update(clock="cpu")
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in timed:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
    total = sum(t for _, t in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    summary.update(
        total_us=total,
        top=[{"name": n, "calls": c, "us": t, "share": t / total if total else 0.0} for n, (c, t) in top],
        router_forward_us=fwd, router_backward_us=bwd, router_share=(fwd + bwd) / total if total else 0.0,
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    """``python -m repro.training.trace TRACE.json[.gz]...``: print each trace's :func:`summarize` as JSON."""
    import sys

    for path in argv if argv is not None else sys.argv[1:]:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt") as f:
            print(json.dumps({"trace": str(path), **summarize(json.load(f))}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
