"""A cluster's time limit is not a crash: SIGTERM mid-run checkpoints the step reached, exits with 75, and the
resumed run ends with the losses of an uninterrupted one (one process, and two under torchrun).

The router is the aux-loss-free one: its bias is state the checkpoint must carry, and under torchrun its
per-step token counts must be summed over the ranks for two processes to train as one (without that sum the
losses part at step 2)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_training import TINY, _read_log

from repro.config import apply_overrides
from repro.experiments import get_experiment
from repro.training.preemption import EXIT_STOPPED

REPO = Path(__file__).resolve().parents[1]
STEPS = 20
# Checkpoints otherwise off: the only checkpoint before the end is the one the signal asks for.
SETS = [*TINY, f"schedule.steps={STEPS}", "data.global_batch_size=8", "data.synthetic_samples=0", "checkpoint.interval=0"]
KEYS = ("step", "loss", "lm_loss", "grad_norm", "lr", "aux_losses", "routing", "routing_per_expert")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    # A fresh process, as the interrupted and the resumed runs: the comparison is bit for bit, so none of the
    # three may inherit state from the tests that ran before in this process.
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = _start(out, torchrun=False)
    _, stderr = done.communicate(timeout=600)
    assert done.returncode == 0, stderr[-3000:]
    return _read_log(out)


def _start(out: Path, torchrun: bool) -> subprocess.Popen:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun else [
        sys.executable]
    cmd = [*launcher, "-m", "repro", "train", "--experiment", "auxfree-tiny", "--out", str(out), "--no-progress"]
    for item in SETS:
        cmd += ["--set", item]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _wait_for_first_step(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 300
    while not (out / "log.jsonl").is_file() or not (out / "log.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, _stop(proc)
        time.sleep(0.02)


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """The output of a process that ended or ran past its deadline (killed first: never a wait without end)."""
    proc.kill()
    return proc.communicate(timeout=60)


def _signalled(out: Path, signum: signal.Signals) -> tuple[int, str]:
    """A one-process run sent ``signum`` after its first step: its exit status and stderr."""
    proc = _start(out, torchrun=False)
    _wait_for_first_step(proc, out)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)
    return proc.returncode, stderr


def _checkpoint_at_the_step_reached(out: Path, stderr: str, name: str = "SIGTERM") -> int:
    steps = [r["step"] for r in _read_log(out)]
    reached = steps[-1]
    assert steps == list(range(1, reached + 1)) and 1 <= reached < STEPS
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_{reached:07d}"]
    assert f"stopped by {name} after step {reached}" in stderr
    assert f"resume with: python -m repro train --out {out} --resume" in stderr
    return reached


def _same_rows(resumed: list[dict], full: list[dict], exact: bool) -> None:
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    if exact:
        assert [{k: r[k] for k in KEYS} for r in resumed] == [{k: r[k] for k in KEYS} for r in full]
        return
    for a, b in zip(full, resumed):
        for key in ("loss", "lm_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a["step"])


def test_sigterm_checkpoints_the_step_reached_and_the_resume_matches(uninterrupted, tmp_path):
    out = tmp_path / "run"
    returncode, stderr = _signalled(out, signal.SIGTERM)
    assert returncode == EXIT_STOPPED, stderr[-3000:]
    _checkpoint_at_the_step_reached(out, stderr)
    assert not (out / "summary.json").exists()

    resume = [sys.executable, "-m", "repro", "train", "--out", str(out), "--resume", "--no-progress"]
    done = subprocess.run(resume, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == STEPS
    _same_rows(_read_log(out), uninterrupted, exact=True)  # fp32 on CPU: bit for bit


def test_ctrl_c_stops_like_sigterm_and_exits_130(tmp_path):
    """SIGINT (Ctrl-C) checkpoints the step reached and says how to resume, with no traceback; exit 130."""
    from repro.training.preemption import EXIT_INTERRUPTED

    out = tmp_path / "run"
    returncode, stderr = _signalled(out, signal.SIGINT)
    assert returncode == EXIT_INTERRUPTED, stderr[-3000:]
    _checkpoint_at_the_step_reached(out, stderr, "SIGINT")
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr


def _worker_of_rank(launcher_pid: int, rank: int) -> int:
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} among {children}")


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds torchrun's workers through /proc")
def test_two_ranks_stop_at_the_same_step_when_one_is_signalled(uninterrupted, tmp_path):
    """Only rank 1 gets SIGTERM: the all-reduced flag stops both after the same step, both write their part of
    the checkpoint and exit with 75, and the resumed two-process run gives the one-process losses."""
    out = tmp_path / "run"
    proc = _start(out, torchrun=True)
    _wait_for_first_step(proc, out)
    os.kill(_worker_of_rank(proc.pid, 1), signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0 and re.search(r"exitcode\s*:\s*75\b", stderr), stderr[-3000:]
    reached = _checkpoint_at_the_step_reached(out, stderr)
    ranks = sorted(p.name for p in (out / "checkpoints" / f"step_{reached:07d}").glob("rank_*.pt"))
    assert ranks == ["rank_00000.pt", "rank_00001.pt"]

    resume = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
              "-m", "repro", "train", "--out", str(out), "--resume", "--no-progress"]
    done = subprocess.run(resume, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    _same_rows(_read_log(out), uninterrupted, exact=False)  # DP=2 against one process, as the DP test


def test_sigusr1_in_process_raises_run_stopped_and_restores_the_handlers(tmp_path, monkeypatch):
    """Callers of train() other than the CLI (the mini comparison, the ablation) get an error, never a summary of
    an unfinished run; the checkpoint is the step's, and the process's own handlers are back afterwards."""
    from repro.training import trainer as trainer_module
    from repro.training.preemption import RunStopped

    real_step = trainer_module.Trainer.train_step

    def step_then_signal(self):
        row = real_step(self)
        if row.step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # arrives mid-run; the step in progress completes
        return row

    monkeypatch.setattr(trainer_module.Trainer, "train_step", step_then_signal)
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    exp = apply_overrides(get_experiment("switch-tiny"), [*TINY, "schedule.steps=4", "checkpoint.interval=2"])
    with pytest.raises(RunStopped, match="stopped by SIGUSR1 after step 2") as info:
        trainer_module.train(exp, tmp_path, progress=False)
    assert (info.value.step, info.value.signal) == (2, "SIGUSR1")
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before
    # the checkpoint of the step reached, and nothing claims the run finished
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_0000002"]
    assert not (tmp_path / "summary.json").exists()
