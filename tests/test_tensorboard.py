"""TensorBoard events (the optional extra): written from log.jsonl's rows, read back with TensorBoard's own reader."""

from __future__ import annotations

import importlib.util
import os

import pytest

from repro.errors import ReproError
from repro.records.step_log import read_rows

if importlib.util.find_spec("tensorboard") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must install the 'tensorboard' extra (noxfile.py's tests session does)")
    pytest.skip("the optional extra 'tensorboard' is not installed", allow_module_level=True)

from test_training import TINY  # noqa: E402 - after the skip


def _accumulator(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _scalars(acc, tag) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_events_equal_the_log_rows_on_logging_steps(tmp_path):
    from repro.cli import main

    run, events = tmp_path / "run", tmp_path / "tb"
    overrides = [*TINY, "schedule.steps=5", "logging.interval=2", "validation.interval=3"]
    argv = ["train", "--experiment", "remoe-tiny", "--out", str(run), "--no-progress", "--tensorboard", str(events)]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == 0
    rows = {r.step: r for r in read_rows(run)}
    acc = _accumulator(events)
    logged = [2, 4, 5]  # every 2 steps and the last
    approx = dict(rel=1e-6)  # events hold float32
    for name in ("loss", "lm_loss", "lr", "grad_norm", "tokens_per_s", "iter_time_s"):
        got = _scalars(acc, f"train/{name}")
        assert sorted(got) == logged, name
        for step in logged:
            assert got[step] == pytest.approx(getattr(rows[step], name), **approx), (name, step)
    # validation at 3 and 5: written whatever the logging cadence
    assert _scalars(acc, "val/loss") == {s: pytest.approx(rows[s].val_loss, **approx) for s in (3, 5)}
    assert _scalars(acc, "train/aux/l1_reg_loss")[4] == pytest.approx(rows[4].aux_losses["l1_reg_loss"], **approx)
    assert _scalars(acc, "train/aux/l1_reg_loss/layer2")[4] == pytest.approx(
        rows[4].aux_losses_per_layer["l1_reg_loss"][1], **approx
    )
    assert _scalars(acc, "router/remoe")[5] == pytest.approx(rows[5].router_stats["remoe"], **approx)
    metrics = rows[5].routing
    assert metrics and {"active_experts", "simpson", "sparsity", "l1_coeff"} <= set(metrics)
    for name, per_layer in metrics.items():
        for layer, value in enumerate(per_layer, 1):
            assert _scalars(acc, f"routing/{name}/layer{layer}")[5] == pytest.approx(value, rel=1e-6, abs=1e-12)
    for layer, loads in enumerate(rows[4].routing_per_expert["tokens_per_expert"], 1):
        (event,) = [e for e in acc.Histograms(f"experts/tokens_per_expert/layer{layer}") if e.step == 4]
        hist = event.histogram_value
        assert list(hist.bucket) == pytest.approx(loads, **approx)  # bucket i: expert i's load
        assert list(hist.bucket_limit) == [i + 0.5 for i in range(len(loads))]
        assert hist.num == pytest.approx(sum(loads), **approx)


def test_default_folder_and_negative_per_expert_values(tmp_path):
    """``logging.tensorboard=true`` writes to <run>/tensorboard; the aux-loss-free bias (negative entries) is
    written as the distribution of its values."""
    from repro.config import apply_overrides
    from repro.experiments import get_experiment
    from repro.training.trainer import train

    exp = apply_overrides(get_experiment("auxfree-tiny"), [*TINY, "schedule.steps=2", "logging.tensorboard=true"])
    train(exp, tmp_path, progress=False)
    acc = _accumulator(tmp_path / "tensorboard")
    row = read_rows(tmp_path)[-1]
    bias = row.routing_per_expert["expert_bias"][0]
    assert min(bias) < 0 < max(bias)
    (event,) = [e for e in acc.Histograms("experts/expert_bias/layer1") if e.step == 2]
    assert event.histogram_value.min == pytest.approx(min(bias)) and event.histogram_value.num == len(bias)


def test_missing_extra_is_one_clear_line(tmp_path, monkeypatch):
    from repro.training import tensorboard

    monkeypatch.setattr(tensorboard.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ReproError, match=r"pip install 'dirmoe-bench\[tensorboard\]'"):
        tensorboard.TensorBoardLog(tmp_path, 1, 2, 0, True)


def test_an_unwritable_events_directory_is_one_line_before_the_run_exists(tmp_path, monkeypatch, capsys):
    """A TensorBoard directory that is a file, lies below a file or under an unwritable directory, or a missing
    TensorBoard, is refused in one line before the run directory is made: the same command can then be rerun."""
    from repro.cli import main
    from repro.training import tensorboard

    base = ["train", "--experiment", "dense-tiny", "--no-progress"]
    for item in TINY + ["schedule.steps=1"]:
        base += ["--set", item]
    (tmp_path / "file").write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    cases = [(tmp_path / "file", f"cannot make the TensorBoard directory: {tmp_path / 'file'} is a file"),
             (tmp_path / "file" / "tb", f"{tmp_path / 'file'} is a file")]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((locked / "tb", f"{locked} is not writable"))
    for target, message in cases:
        run = tmp_path / "run"
        assert main(base + ["--out", str(run), "--tensorboard", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
        assert not run.exists()
    monkeypatch.setattr(tensorboard.importlib.util, "find_spec", lambda name: None)
    assert main(base + ["--out", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb")]) == 2
    assert "pip install 'dirmoe-bench[tensorboard]'" in capsys.readouterr().err and not (tmp_path / "run").exists()
