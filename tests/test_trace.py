"""The step trace (``logging.trace_step``, :mod:`repro.training.trace`): what it records and how
:func:`~repro.training.trace.summarize` attributes device time to the routers."""

from __future__ import annotations

import gzip
import json

import pytest
from test_training import TINY

from repro.config import apply_overrides
from repro.experiments import get_experiment
from repro.training.trace import ROUTER_RANGE, summarize


def _op(name, tid, ts, dur, seq=None, cat="cpu_op"):
    args = {} if seq is None else {"Sequence number": seq}
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _kernel(name, correlation, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": correlation}}


def _launch(tid, ts, correlation, name="cudaLaunchKernel", cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": 1, "args": {"correlation": correlation}}


def test_device_time_is_attributed_to_the_router_forward_and_its_backward_nodes():
    """A router range on the main thread (1) launches kernel A through an op with sequence number 5; the
    backward thread (2) runs op 5's backward node, which launches B, and another node (seq 9), which launches C;
    D is launched outside every range. Annotations on the device timeline count nothing."""
    events = [
        _op(ROUTER_RANGE, 1, 100, 50, cat="user_annotation"),
        _op("aten::mm", 1, 110, 10, seq=5),
        _launch(1, 112, correlation=1),
        _op("aten::add", 1, 200, 10, seq=9),
        _launch(1, 202, correlation=4, name="cuLaunchKernel", cat="cuda_driver"),
        _op("autograd::engine::evaluate_function: MmBackward0", 2, 300, 20, seq=5),
        _launch(2, 305, correlation=2),
        _op("autograd::engine::evaluate_function: AddBackward0", 2, 330, 20, seq=9),
        _launch(2, 335, correlation=3),
        _kernel("A", 1, 1000, 40),
        _kernel("B", 2, 1030, 30),  # overlaps A by 10 us
        _kernel("C", 3, 1100, 20),
        _kernel("D", 4, 1200, 10),
        {"ph": "X", "cat": "gpu_user_annotation", "name": ROUTER_RANGE, "pid": 0, "tid": 7, "ts": 1000, "dur": 500},
    ]
    s = summarize({"traceEvents": events})
    assert s["clock"] == "cuda"
    assert s["router_calls"] == 1 and s["router_host_us"] == 50
    assert (s["router_forward_us"], s["router_backward_us"], s["router_launches"]) == (40, 30, 2)
    assert s["total_us"] == 100 and s["busy_us"] == 90 and s["launches"] == 4
    assert s["router_share"] == pytest.approx(0.7)
    assert [t["name"] for t in s["top"]] == ["A", "B", "C", "D"]


def test_a_trace_without_device_work_is_summarised_in_host_time():
    events = [
        _op(ROUTER_RANGE, 1, 100, 50, cat="user_annotation"),
        _op("aten::mm", 1, 110, 30, seq=5),
        _op("aten::mm_inner", 1, 115, 10),  # nested: not counted twice
        _op("aten::add", 1, 200, 10, seq=9),
        _op("autograd::engine::evaluate_function: MmBackward0", 2, 300, 20, seq=5),
    ]
    s = summarize({"traceEvents": events})
    assert s["clock"] == "cpu"
    assert (s["router_forward_us"], s["router_backward_us"]) == (50, 20)
    assert s["total_us"] == 60  # mm 30 + add 10 + the backward node 20
    assert {t["name"]: t["us"] for t in s["top"]} == {"aten::mm": 30, "aten::add": 10,
                                                      "autograd::engine::evaluate_function: MmBackward0": 20}


@pytest.mark.parametrize("router", ["switch", "dense"])
def test_trace_step_records_that_step_with_every_router_call(router, tmp_path):
    """Step 2 of a tiny run (2 layers x 2 micro-batches): a Chrome trace, and a summary whose router figures
    come from the 4 router calls (none for dense); the run's log and training are as without a trace."""
    from repro.training.trainer import train

    config = apply_overrides(get_experiment(f"{router}-tiny"), TINY + ["schedule.steps=3", "logging.trace_step=2"])
    train(config, tmp_path, progress=False)
    summary = json.loads((tmp_path / "trace" / "summary.json").read_text())
    with gzip.open(tmp_path / "trace" / "trace.json.gz", "rt") as f:
        trace = json.load(f)
    assert summary["step"] == 2 and summary["clock"] == "cpu"
    assert summarize(trace)["router_calls"] == summary["router_calls"] == (4 if router == "switch" else 0)
    if router == "switch":
        assert summary["router_forward_us"] > 0 and summary["router_backward_us"] > 0
        assert 0 < summary["router_share"] < 1
    else:
        assert summary["router_forward_us"] == summary["router_backward_us"] == 0
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 3


def test_trace_step_must_be_0_or_at_least_2():
    from repro.errors import ReproError

    with pytest.raises(ReproError, match="logging.trace_step must be 0"):
        apply_overrides(get_experiment("switch-tiny"), ["logging.trace_step=1"])
