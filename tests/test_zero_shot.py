"""End to end: a tiny checkpoint trained for a few steps, evaluated on the papers' seven tasks from a task-data
folder (the fixtures) through lm-eval's own task definitions, offline, and the seven-column zero-shot table."""

from __future__ import annotations

import csv
import json
import socket
from pathlib import Path

import pytest

from repro.cli import main as repro_main

pytestmark = pytest.mark.slow

TASKS_DATA = Path(__file__).parent / "fixtures" / "tasks_data"
SEVEN = ("arc_challenge", "arc_easy", "boolq", "hellaswag", "lambada_openai", "piqa", "race")
LABELS = ("ARC-c", "ARC-e", "BoolQ", "HellaSwag", "LAMBADA", "PIQA", "RACE")


def _train_tiny(run_dir: Path, data_dir: Path, steps: int = 2) -> None:
    """Train ``switch-tiny`` on the mini-pile for a few steps with the training command (in this process)."""
    argv = ["train", "--experiment", "switch-tiny", "--out", str(run_dir), "--set", f"data.source=mini-pile:{data_dir}",
            "--set", f"schedule.steps={steps}", "--no-progress"]
    assert repro_main(argv) == 0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, mini_pile):
    root = tmp_path_factory.mktemp("zero-shot")
    _train_tiny(root / "run", mini_pile)
    yield root / "run"
    from repro.model.parallel import destroy_distributed

    destroy_distributed()  # evaluation set up megatron's process groups in this process


@pytest.fixture()
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_checkpoint_on_the_seven_tasks_and_the_zero_shot_table(run_dir, tmp_path, no_network, capsys):
    out = tmp_path / "lm_eval.json"
    argv = ["eval", "--checkpoint", str(run_dir), "--tasks-data", str(TASKS_DATA), "--out", str(out)]
    assert repro_main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == set(SEVEN)
    for task in SEVEN:
        assert 0 <= results[task]["acc,none"] <= 1 and isinstance(results[task]["acc_stderr,none"], float)
    assert {t for t in SEVEN if "acc_norm,none" in results[t]} == {"arc_challenge", "arc_easy", "hellaswag", "piqa"}
    assert f"updated {run_dir / 'record.json'}" in capsys.readouterr().out

    tables = tmp_path / "tables"
    for metric in ("auto", "acc"):
        assert repro_main(["report", "tables", str(run_dir / "record.json"), "--metric", metric,
                           "--out", str(tables / metric), "--format", "md,csv"]) == 0
    auto = list(csv.reader((tables / "auto" / "zero_shot.csv").open()))
    assert auto[0] == ["Router", *LABELS, "Avg."] and auto[1][0] == "switch"
    # acc_norm where the task reports it (as the papers' table), acc otherwise; +- lm-eval's standard error
    for task, cell in zip(SEVEN, auto[1][1:8]):
        metric = "acc_norm" if "acc_norm,none" in results[task] else "acc"
        value, error = results[task][f"{metric},none"], results[task][f"{metric}_stderr,none"]
        assert cell == f"{100 * value:.2f} \u00b1 {100 * error:.2f}", task
    acc = list(csv.reader((tables / "acc" / "zero_shot.csv").open()))
    assert [c.split(" ")[0] for c in acc[1][1:8]] == [f"{100 * results[t]['acc,none']:.2f}" for t in SEVEN]
    caption = (tables / "auto" / "zero_shot.md").read_text()
    assert "ARC-c acc_norm" in caption and "BoolQ acc" in caption and "standard error" in caption


def test_a_folder_without_a_tasks_data_is_one_line_and_writes_nothing(run_dir, tmp_path, no_network, capsys):
    partial = tmp_path / "tasks_data"
    (partial / "EleutherAI").mkdir(parents=True)
    out = tmp_path / "lm_eval.json"
    argv = ["eval", "--checkpoint", str(run_dir), "--tasks-data", str(partial), "--tasks", "race", "--out", str(out)]
    assert repro_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: task 'race': no EleutherAI/race in {partial.resolve() / 'EleutherAI' / 'race'}")
    assert err.count("\n") == 1 and not out.exists()
