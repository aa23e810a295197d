"""The study engine: a study registered as data runs through ``python -m repro study NAME`` (CPU lanes, reuse,
the run-directory claim), and the launched form builds one ``python -m repro train`` (torchrun) per run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from repro.errors import ReproError
from repro.launch import Launch
from repro.studies import engine
from repro.studies import registry as studies
from repro.studies.engine import Run, Study, run_state, train_command
from repro.studies.registry import Sweep, register


@pytest.fixture
def tiny_sweep(monkeypatch):
    """A user's study: Switch at k = 1 and k = 2, four steps each, registered for this test only."""
    monkeypatch.setattr(studies, "SWEEPS", dict(studies.SWEEPS))
    return register(Sweep("tiny-k", "Switch at k = 1, 2 (four steps)", "model.top_k", (1, 2), "k", ("switch",),
                          overrides=("schedule.steps=4", "validation.interval=0", "checkpoint.interval=0"),
                          flavour="tiny", gpus=0))


def test_a_registered_study_is_listed_and_a_name_is_taken_once(tiny_sweep, capsys):
    assert studies.main(["--list"]) == 0
    assert "tiny-k" in capsys.readouterr().out
    with pytest.raises(ValueError, match="exists already"):
        register(tiny_sweep)
    with pytest.raises(ReproError, match="unknown study 'nope'; valid: mini, ablation, efficiency, .*tiny-k"):
        studies.main(["nope"])


@pytest.mark.slow
def test_a_registered_study_runs_through_the_engine(tiny_sweep, tmp_path, mini_pile, capsys):
    argv = ["tiny-k", "--out", str(tmp_path), "--set", f"data.source=mini-pile:{mini_pile}"]
    assert studies.main(argv) == 0
    runs = tmp_path / "tiny-k"
    for k in (1, 2):
        record = json.loads((runs / f"switch-k{k}" / "record.json").read_text())
        config = json.loads((runs / f"switch-k{k}" / "config.json").read_text())["experiment"]
        assert record["run_id"] == f"switch-k{k}" and config["model"]["top_k"] == k
        assert (runs / f"switch-k{k}" / ".tiny-k-run").is_file()
        assert json.loads((runs / f"switch-k{k}" / "timing.json").read_text())["cpu_seconds"] > 0
    assert json.loads((runs / "sessions.json").read_text())[-1]["trained"] == ["switch-k1", "switch-k2"]
    capsys.readouterr()
    assert studies.main([*argv, "--values", "2"]) == 0  # a part of the grid, finished: reused
    assert "reusing finished runs: switch-k2" in capsys.readouterr().out


def _study(tmp_path, **kwargs) -> Study:
    runs = (Run("a", "switch-tiny", ("schedule.steps=3",)), Run("b", "dense-tiny", ("schedule.steps=3",)))
    return Study("demo", runs, str(tmp_path / "runs"), **kwargs)


def test_run_states_and_the_claim(tmp_path):
    study = _study(tmp_path)
    run_a, run_b = study.runs
    assert run_state(study, run_a) == "new"
    (tmp_path / "runs" / "b").mkdir(parents=True)
    (tmp_path / "runs" / "b" / "notes.txt").write_text("keep me")
    assert run_state(study, run_b) == "foreign"
    with pytest.raises(ReproError, match="runs/b: exists and was not created by python -m repro study demo"):
        engine.claim(study)
    assert not (tmp_path / "runs" / "a").exists()  # nothing claimed while one is foreign
    (tmp_path / "runs" / "b" / "notes.txt").unlink()
    (tmp_path / "runs" / "b").rmdir()
    assert engine.claim(study) == {"a": "new", "b": "new"}
    assert (tmp_path / "runs" / "a" / ".demo-run").is_file()
    # this study's run with the same config but unfinished: resumed where the study resumes, else replaced
    (tmp_path / "runs" / "a" / "config.json").write_text(json.dumps({"experiment": run_a.config().to_dict()}))
    assert run_state(study, run_a) == "new" and run_state(_study(tmp_path, resume=True), run_a) == "resume"
    (tmp_path / "runs" / "a" / "record.json").write_text("{}")
    assert run_state(study, run_a) == "done"
    assert run_state(_study(tmp_path, current=lambda s, r: False), run_a) == "new"


def test_a_launched_run_is_one_train_command(tmp_path):
    one = _study(tmp_path, launch=Launch(1, 1), train_args=("--stop-after", "2"))
    cmd = train_command(one, one.runs[0])
    assert cmd[:5] == [sys.executable, "-m", "repro", "train", "--experiment"] and "--resume" not in cmd
    assert cmd[cmd.index("--set") + 1] == "schedule.steps=3" and cmd[-2:] == ["--stop-after", "2"]
    nodes = _study(tmp_path, launch=Launch(2, 8, "head:29500"), resume=True)
    cmd = train_command(nodes, nodes.runs[1], resume=True)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nnodes=2" in cmd and cmd[-1] == "--resume"
    assert any(a.startswith("--rdzv_id=") and a.endswith("runs-b") for a in cmd)  # the same on every node
    assert nodes.shared and engine.claim(nodes) == {"a": "new", "b": "new"}  # the trainer's checks hold there
    assert not (tmp_path / "runs").exists()


def test_launched_runs_import_this_checkout_from_any_directory(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(engine.subprocess, "run", lambda cmd, env, check: seen.append(env) or
                        engine.subprocess.CompletedProcess(cmd, 0))
    monkeypatch.chdir(tmp_path)
    study = _study(tmp_path, launch=Launch(1, 1))
    seconds, failed = engine._launched(study, list(study.runs), {"a": "new", "b": "new"})
    assert not failed and set(seconds) == {"a", "b"}
    first = Path(seen[0]["PYTHONPATH"].split(os.pathsep)[0])
    assert (first / "repro" / "__init__.py").is_file() and first == Path(engine.__file__).resolve().parents[2]


def test_a_runs_cost_is_its_timing_or_an_earlier_ablations_invocations(tmp_path):
    from repro.studies.engine import run_cost

    assert run_cost(tmp_path) is None
    (tmp_path / "ablation_cost.json").write_text(json.dumps([{"cpu_seconds": 10.04, "wall_seconds": 20},
                                                             {"cpu_seconds": 1, "wall_seconds": 2}]))
    assert run_cost(tmp_path) == {"cpu_seconds": 11.0, "wall_seconds": 22.0}  # summed, as the ablation did
    (tmp_path / "timing.json").write_text(json.dumps({"cpu_seconds": 3, "wall_seconds": 4}))
    assert run_cost(tmp_path) == {"cpu_seconds": 3.0, "wall_seconds": 4.0}


def test_a_run_builds_its_config_once_and_carries_it_to_its_worker():
    """The config is built on the first call and kept, also across pickling (the worker's copy); equality and
    hashing stay the fields'."""
    import pickle

    from repro.studies.engine import Run

    run = Run("r", "switch-tiny", ("schedule.steps=7",))
    first = run.config()
    assert run.config() is first and first.schedule.steps == 7
    copy = pickle.loads(pickle.dumps(run))
    assert copy.__dict__["_config"] == first and copy == run and hash(copy) == hash(run)
    assert Run("r", "switch-tiny", ("schedule.steps=7",)) == run


OUTSIDE_STUDY = '''\
"""Switch at two learning rates: a study defined outside the suite, with its own table and write-up."""
import json
from pathlib import Path

from repro.records.store import load_record
from repro.report.table_core import Table, render, write_tables
from repro.report.verdicts import Writeup, page
from repro.studies.engine import Run, Study, run_study

#: report writeup keeps results/lr-probe/README.md in step with its summary.json.
WRITEUPS = {"lr-probe": "my_studies.lr_probe:writeup"}


def report(study, outcome):
    rows = []
    for run in study.runs:
        record = load_record(study.run_dir(run) / "record.json")
        rows.append((run.run_id, f"{record.loss_curve[-1].loss:.4f}"))
    table = Table("lr_probe", "Final training loss per learning rate.", ("run", "final loss"), tuple(rows))
    write_tables([table], study.out_dir)
    Path(study.out_dir, "summary.json").write_text(json.dumps({"final_loss": {r: float(v) for r, v in rows}}))
    return render(table, "md")


def writeup(directory):
    losses = json.loads((directory / "summary.json").read_text())["final_loss"]
    findings = [f"Lowest final loss: {min(losses, key=losses.get)}."]
    readme = page("LR probe", "python -m repro study lr-probe", findings, [directory / "lr_probe.md"])
    return Writeup(directory.name, readme, findings[0])


def main(argv, prog):
    out, work = argv
    runs = tuple(Run(f"lr{lr}", "switch-tiny", (f"optimizer.lr={lr}", "schedule.steps=3", "data.source=synthetic",
                                               "validation.interval=0", "checkpoint.interval=0"))
                 for lr in ("0.001", "0.01"))
    study = Study("lr-probe", runs, work, out, report=report, workers=1, owner=prog)
    return 1 if run_study(study)["failed"] else 0
'''


def test_a_write_up_that_cannot_load_or_claims_a_taken_directory_is_one_line(tmp_path, monkeypatch, capsys):
    from repro.cli import main as cli_main

    (tmp_path / "bad_studies").mkdir()
    (tmp_path / "bad_studies" / "__init__.py").write_text("")
    (tmp_path / "bad_studies" / "typo.py").write_text('WRITEUPS = {"typo": "bad_studies.typo:nope"}\n')
    (tmp_path / "bad_studies" / "twin.py").write_text('WRITEUPS = {"mini": "repro.studies.mini_writeup:mini"}\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(studies, "ALIASES", dict(studies.ALIASES))
    studies.register_study("typo", "bad_studies.typo", "a write-up that is not there")
    assert cli_main(["report", "writeup", "--root", str(tmp_path), "--check"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: study 'typo': its write-up of results/typo, 'bad_studies.typo:nope', cannot be loaded")
    del studies.ALIASES["typo"]
    studies.register_study("twin", "bad_studies.twin", "a second write-up of results/mini")
    assert cli_main(["report", "writeup", "--root", str(tmp_path), "--check"]) == 2
    assert "error: results/mini has two write-ups; the second is study 'twin''s" in capsys.readouterr().err


@pytest.mark.slow
def test_a_study_from_outside_the_package_runs_with_its_own_table_and_write_up(tmp_path, monkeypatch, capsys):
    """A package of a user's registers a study (runs, table, write-up) and ``python -m repro study NAME`` runs it:
    no file of the suite is touched."""
    from repro.cli import main as cli_main

    (tmp_path / "my_studies").mkdir()
    (tmp_path / "my_studies" / "__init__.py").write_text("")
    (tmp_path / "my_studies" / "lr_probe.py").write_text(OUTSIDE_STUDY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(studies, "ALIASES", dict(studies.ALIASES))
    studies.register_study("lr-probe", "my_studies.lr_probe", "Switch at two learning rates")
    with pytest.raises(ValueError, match="exists already"):
        studies.register_study("lr-probe", "my_studies.lr_probe", "again")
    assert cli_main(["study", "--list"]) == 0 and "lr-probe" in capsys.readouterr().out
    out, work = tmp_path / "repo" / "results" / "lr-probe", tmp_path / "work"
    assert cli_main(["study", "lr-probe", str(out), str(work)]) == 0
    rows = (out / "lr_probe.csv").read_text().splitlines()
    assert rows[0] == "run,final loss" and [r.split(",")[0] for r in rows[1:]] == ["lr0.001", "lr0.01"]
    losses = {r.split(",")[0]: float(r.split(",")[1]) for r in rows[1:]}
    assert all(0 < v < 20 for v in losses.values())
    assert cli_main(["report", "writeup", "--root", str(tmp_path / "repo")]) == 0  # the study's own write-up
    assert f"Lowest final loss: {min(losses, key=losses.get)}." in (out / "README.md").read_text()
    assert cli_main(["report", "writeup", "--root", str(tmp_path / "repo"), "--check"]) == 0
    assert json.loads((work / "lr0.01" / "config.json").read_text())["experiment"]["optimizer"]["lr"] == 0.01
