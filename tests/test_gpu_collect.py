"""The GPU check's two scripts on CPU: ``benchmarks/gpu_measure.sh`` runs its interleave phase on the tiny model
and ``benchmarks/gpu_collect.py`` turns the call's archive into ``results/<device>/`` whose README holds the
figures of the phase's own ``summary.json``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_collect  # noqa: E402


def test_environment_and_pytest_lines_are_read(tmp_path):
    env = tmp_path / "environment.txt"
    env.write_text("2026-11-29T00:00:00Z\nabcdef0123456789\nboot id 1234567890\npython 3.12 torch 2.11 cuda 13.0\n"
                   "megatron-core 0.16.1 triton 3.5\ndevice NVIDIA H200 sm 90 SMs 132 mem GiB 139.8\n"
                   "bf16 matmul 8192^3: 812 TFLOP/s (mean of 20, random data)\n")
    facts = gpu_collect.environment(env)
    assert facts["commit"] == "abcdef0123" and facts["device"].startswith("NVIDIA H200") and facts["boot id"] == "12345678"
    assert facts["bf16 peak"].startswith("812 TFLOP/s") and "megatron-core 0.16.1" in facts["software"]
    log = tmp_path / "pytest.log"
    log.write_text("..F.\nFAILED tests/test_gpu.py::test_a[switch] - assert 1\nERROR tests/test_gpu.py::test_b\n"
                   "==== 1 failed, 2 passed, 1 error in 12.3s ====\n")
    assert gpu_collect.pytest_outcome(log) == ("1 failed, 2 passed, 1 error in 12.3s",
                                               ["tests/test_gpu.py::test_a[switch]", "tests/test_gpu.py::test_b"])
    assert gpu_collect.pytest_outcome(tmp_path / "none.log") == ("", [])


def test_a_bad_archive_or_an_existing_out_is_one_line_and_leaves_nothing(tmp_path):
    (tmp_path / "call").mkdir()
    (tmp_path / "call" / "gpu.tgz").write_text("not a tar")
    with pytest.raises(SystemExit, match=r"^error: .*gpu.tgz: not a readable gpu_measure.sh archive"):
        gpu_collect.main(["--out", str(tmp_path / "res"), str(tmp_path / "call")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["call"]
    with pytest.raises(SystemExit, match="exists: choose a new --out"):
        gpu_collect.main(["--out", str(tmp_path / "call"), str(tmp_path / "call")])


@pytest.mark.slow
def test_a_cpu_call_of_the_gpu_check_is_collected_with_its_own_figures(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), PYTHON=sys.executable,
               PHASES="interleave", BUDGET="300",
               INTERLEAVE_ARGS="--router switch,dirmoe --flavour tiny --vocab-size 8192 --warmup 2 --iters 8")
    done = subprocess.run(["bash", "benchmarks/gpu_measure.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "interleave rc=0" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    with tarfile.open(tmp_path / "out" / "gpu.tgz") as tar:
        assert "./interleave/summary.json" in tar.getnames()
    assert gpu_collect.main(["--out", str(tmp_path / "res"), str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "res" / "call1" / "interleave" / "summary.json").read_text())
    ratio = summary["runs"]["dirmoe"]["interleaved"]
    text = (tmp_path / "res" / "README.md").read_text()
    median = summary["runs"]["dirmoe"]["iter_time_ms"]["median"]
    assert re.search(rf"\|\s*dirmoe\s*\|\s*{median:.1f} \(", text), text
    assert f"{ratio['ratio']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}], detects {ratio['detectable']:.1%}" in text
    assert "- phases: interleave rc=0" in text and (tmp_path / "res" / "call1" / "interleave" / "runs").is_dir()
    low, high = ratio["low"], ratio["high"]
    assert f"- dirmoe / switch, wall: {ratio['ratio']:.3f} [{low:.3f}, {high:.3f}] (goal <= 1.01: " in text


def _run(median_ms, tflops, ratio=None, trace=None):
    return {"iter_time_ms": {"median": median_ms, "min": median_ms, "max": median_ms},
            "tflops_per_device_analytic": tflops, "interleaved": ratio, "trace": trace}


def _ratio(ratio, low, high):
    return {"ratio": ratio, "low": low, "high": high, "half_width": (high - low) / (2 * ratio), "rounds": 120,
            "detectable": 0.01, "device": None}


def _trace(busy, device_ms, launches, calls=96):
    return {"busy_share": busy, "span_ms": 300.0, "launches": 8000, "router_device_ms": device_ms,
            "router_launches": launches, "router_calls": calls}


@pytest.mark.parametrize(("low", "high", "verdict", "width"), [
    (1.002, 1.009, "met: the whole interval is at or below it", "0.35% (goal <= 1%: met)"),
    (1.011, 1.030, "not met: the whole interval is above it", "0.93% (goal <= 1%: met)"),
    (1.000, 1.040, "undecided: the interval holds it", "1.96% (goal <= 1%: not met)"),
])
def test_a_phase_is_read_against_the_goals_by_its_interval(low, high, verdict, width):
    mid = (low + high) / 2
    summary = {"measured_iterations": 150, "runs": {
        "switch": _run(300.0, 210.0, trace=_trace(0.93, 9.6, 1920)),
        "dirmoe": _run(300.0 * mid, 190.0, _ratio(mid, low, high), _trace(0.91, 15.36, 2304)),
        "switch-all": _run(280.0, 260.0, trace=_trace(0.80, 9.6, 1920)),
        "dense": {"error": "out of memory"}}}
    lines = gpu_collect.goal_lines(summary)
    assert len(lines) == 4, lines
    assert lines[0].startswith(f"dirmoe / switch, wall: {mid:.3f} [{low:.3f}, {high:.3f}] (goal <= 1.01: {verdict})")
    assert f"); half-width {width}, 120 rounds." in lines[0]
    assert lines[1] == ("switch: 210 TFLOP/s per device at the median of 150 steps (goal >= 200, stretch 250: "
                        "reached); device busy 93% of its traced step (goal >= 90%: reached).")
    assert "stretch 250: stretch reached); device busy 80% of its traced step (goal >= 90%: below)" in lines[2]
    # 15.36 / 96 = 0.16 ms against 0.1 (1.6x); 24 against 20 launches per call (1.2x).
    assert lines[3] == ("dirmoe's routers per call, one traced step each (no interval): device ms 0.16 against 0.1 "
                        "(1.60x: above 1.3x); launches 24 against 20 (1.20x: within 1.3x).")
    # The table states each run's active experts per token (DirMoE's k is learnt); a failed run keeps its row.
    summary["runs"]["dirmoe"]["mean_active_experts"] = 1.0712
    rows = [[cell.strip() for cell in row.split("|")[1:-1]] for row in gpu_collect.phase_table(summary).splitlines()]
    column, table = rows[0].index("active experts"), {row[0]: row for row in rows[2:]}
    assert (table["dirmoe"][column], table["switch"][column]) == ("1.07", "--")
    assert table["dense"][1] == "FAILED: out of memory" and len(table["dense"]) == len(rows[0])
    summary["runs"]["switch"]["tflops_per_device_analytic"] = 150.0
    summary["runs"]["switch"]["iterations"] = 37  # a phase stopped at its time limit: the steps it measured
    assert "at the median of 37 steps (goal >= 200, stretch 250: below)" in gpu_collect.goal_lines(summary)[1]
