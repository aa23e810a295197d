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
