"""End to end on the embedded default: ``python -m repro study mini`` for a few routers at a few steps, then the
tables, the plots and the regression check (passing against itself, failing against a nudged copy); a second
seed added to finished runs, and the tables over seeds."""

from __future__ import annotations

import csv
import json

import pytest

from repro.errors import ReproError
from repro.report.cli import check_main
from repro.studies import mini
from repro.studies.engine import Run, longest_first, previous_cpu_seconds

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("quick_mini")]


def _argv(runs: str, data, root, out: str, *extra: str) -> list[str]:
    """The comparison of ``runs`` in ``root/runs``, its outputs in ``root/out``: four steps, four documents a task."""
    argv = ["--runs", runs, "--steps", "4", "--eval-limit", "4", "--set", "validation.interval=2"]
    argv += ["--set", "checkpoint.interval=4", "--data-dir", str(data), "--work-dir", str(root / "runs")]
    return [*argv, "--out", str(root / out), *extra]


@pytest.fixture(scope="module")
def comparison(tmp_path_factory, mini_pile):
    root = tmp_path_factory.mktemp("mini")
    assert mini.main(_argv("switch,dirmoe,lory,expert_choice,dirmoe+centered", mini_pile, root, "out")) == 0
    return root


def test_tables_plots_and_records(comparison):
    out = comparison / "out"
    for table in ("zero_shot", "efficiency", "routing", "validation"):
        for fmt in ("md", "csv", "tex"):
            assert (out / f"{table}.{fmt}").is_file(), f"{table}.{fmt}"
    assert not (out / "zero_shot_seeds.md").exists()  # one seed: the per-run tables only
    zero_shot = (out / "zero_shot.md").read_text()
    assert "switch" in zero_shot and "dirmoe" in zero_shot and "Last word" in zero_shot
    # --eval-limit 4 cuts every local task: marked, with lm-eval's standard errors beside each cell
    assert " ± " in zero_shot and "†" in zero_shot and "4 of 175 documents" in zero_shot
    validation = (out / "validation.md").read_text()
    assert "valid split" in validation and "held-out" in validation
    for domain in ("c_headers", "licenses", "man_pages", "python_code", "python_docstrings", "python_reference"):
        assert domain in validation
    record = json.loads((comparison / "runs" / "switch" / "record.json").read_text())
    assert {d["domain"] for d in record["domain_losses"]} >= {"licenses", "python_code"}
    assert all(0 < d["loss"] < 20 and d["tokens"] > 0 for d in record["domain_losses"])
    scores = record["per_question"]["minipile_continuation"]["acc_norm"]
    assert len(scores) == 4 and set(scores) <= {0, 1}
    assert sum(scores) / 4 == pytest.approx(record["lm_eval"]["results"]["minipile_continuation"]["acc_norm,none"])
    timing = json.loads((comparison / "runs" / "switch" / "timing.json").read_text())
    assert timing["cpu_seconds"] > 0 and timing["wall_seconds"] > 0
    for plot in ("loss_curves", "routing_over_training", "specialisation_dirmoe_vs_switch", "dirmoe_sparsity_knob"):
        png = out / f"{plot}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
    summary = json.loads((out / "summary.json").read_text())
    assert summary["unigram_loss"] > 0
    runs = {"switch", "dirmoe", "lory", "expert_choice", "dirmoe+centered"}
    assert set(summary["final_train_lm_loss_last10"]) == set(summary["heldout_loss"]) == runs
    # the variant is a run of its own, beside the router's (not folded into its row or its numbers)
    assert summary["heldout_loss"]["dirmoe+centered"] != summary["heldout_loss"]["dirmoe"]
    assert "| dirmoe+centered " in (out / "routing.md").read_text()
    analysis = json.loads((comparison / "runs" / "dirmoe" / "analysis.json").read_text())
    knob = analysis["sparsity_knob"]
    assert knob["theory"] == sorted(knob["theory"], reverse=True), "the Lemma's curve decreases in lambda"


def test_check_passes_against_itself_and_fails_when_nudged(comparison, tmp_path, capsys):
    record = comparison / "runs" / "switch" / "record.json"
    assert check_main([str(record), "--against", str(record)], prog="check") == 0
    nudged = json.loads(record.read_text())
    nudged["loss_curve"][-1]["loss"] *= 1.001
    (tmp_path / "record.json").write_text(json.dumps(nudged))
    assert check_main([str(tmp_path / "record.json"), "--against", str(record)], prog="check") == 1


def test_a_run_directory_it_did_not_create_is_refused_not_deleted(tmp_path, mini_pile):
    foreign = tmp_path / "runs" / "switch"
    foreign.mkdir(parents=True)
    (foreign / "precious.txt").write_text("keep me")
    # the refusal comes after the data and the tasks are ready: the shared mini-pile, not a build of its own
    argv = ["--runs", "switch", "--steps", "2", "--data-dir", str(mini_pile), "--work-dir", str(tmp_path / "runs"),
            "--out", str(tmp_path / "out")]
    with pytest.raises(ReproError, match="exists and was not created by the mini comparison"):
        mini.main(argv)
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_every_run_directory_is_checked_before_any_is_replaced(tmp_path, mini_pile):
    """A stale run directory of this command is replaced only once no other one is foreign."""
    runs = tmp_path / "runs"
    (runs / "dirmoe").mkdir(parents=True)
    (runs / "dirmoe" / ".mini-run").write_text("created by python -m repro study mini\n")
    (runs / "dirmoe" / "stale.txt").write_text("an unfinished run")
    (runs / "switch").mkdir()
    (runs / "switch" / "precious.txt").write_text("keep me")
    argv = ["--runs", "dirmoe,switch", "--steps", "2", "--data-dir", str(mini_pile), "--work-dir", str(runs),
            "--out", str(tmp_path / "out")]
    with pytest.raises(ReproError, match="switch: exists and was not created by the mini comparison"):
        mini.main(argv)
    assert (runs / "dirmoe" / "stale.txt").is_file() and (runs / "switch" / "precious.txt").is_file()


def test_an_output_directory_of_another_command_is_refused_before_any_work(tmp_path):
    other = tmp_path / "other-results"
    other.mkdir()
    (other / "summary.json").write_text('{"another": "command"}')
    argv = ["--runs", "switch", "--data-dir", str(tmp_path / "data"), "--work-dir", str(tmp_path / "runs"),
            "--out", str(other)]
    with pytest.raises(ReproError, match="other-results: exists and was not written by python -m repro study mini"):
        mini.main(argv)
    assert (other / "summary.json").read_text() == '{"another": "command"}' and not (tmp_path / "data").exists()


def test_reruns_reuse_finished_runs(comparison, mini_pile, capsys):
    assert mini.main(_argv("switch", mini_pile, comparison, "out2")) == 0
    assert "reusing finished runs: switch" in capsys.readouterr().out


def test_a_second_seed_reuses_the_first_and_adds_tables_over_seeds(comparison, mini_pile, capsys):
    first = (comparison / "runs" / "switch" / "record.json").read_bytes()
    assert mini.main(_argv("switch,dirmoe", mini_pile, comparison, "out3", "--seeds", "2")) == 0
    printed = capsys.readouterr().out
    assert "reusing finished runs: switch, dirmoe" in printed and "training 2 runs" in printed
    assert (comparison / "runs" / "switch" / "record.json").read_bytes() == first  # seed 0 untouched
    seed_0 = json.loads((comparison / "runs" / "switch" / "config.json").read_text())["experiment"]["seed"]
    seed_1 = json.loads((comparison / "runs" / "switch-s1" / "config.json").read_text())["experiment"]
    assert seed_1["seed"] == seed_0 + 1 and (comparison / "runs" / "switch-s1" / ".mini-run").is_file()
    assert json.loads((comparison / "runs" / "switch-s1" / "record.json").read_text())["run_id"] == "switch-s1"
    out = comparison / "out3"
    for table in ("zero_shot_seeds", "validation_seeds", "routing_seeds"):
        text = (out / f"{table}.md").read_text()
        assert "| switch (reference) |" in text and "95% Student-t confidence interval" in text, table
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == 2 and summary["per_seed"]["dirmoe"]["seed"] == [seed_0, seed_0 + 1]
    assert set(summary["run_cpu_seconds"]) == {"switch", "dirmoe", "switch-s1", "dirmoe-s1"}
    assert sorted(summary["trained_runs"]) == ["dirmoe-s1", "switch-s1"]
    # The tests behind the seed tables, as the write-up reads them: the routing table's cells, number for number.
    rows = {r["Router"].split(" (")[0]: r for r in csv.DictReader((out / "routing_seeds.csv").open())}
    cells = summary["over_seeds"]["routing"]["cells"]
    assert set(cells) == set(rows) == {"switch", "dirmoe"}
    for router, row in rows.items():
        assert row["load imbalance"].startswith(format(cells[router]["load imbalance"]["mean"], ".2f"))
        assert row["load imbalance"].endswith("*") == cells[router]["load imbalance"]["marked"]
    # Every run's record beside the tables: the band `report check RUN --against out3` reads.
    from repro.records.store import load_records

    assert sorted(r.run_id for r in load_records([out / "records"])) == ["dirmoe", "dirmoe-s1", "switch", "switch-s1"]


def test_the_tables_do_not_depend_on_the_number_of_workers(comparison, mini_pile):
    """The same runs trained one at a time give the same zero-shot, validation and routing tables (each run is
    its own single-threaded process; only timings differ)."""
    assert mini.main(_argv("switch,dirmoe", mini_pile, comparison, "one-lane", "--workers", "1",
                           "--work-dir", str(comparison / "one-lane-runs"))) == 0
    assert mini.main(_argv("switch,dirmoe", mini_pile, comparison, "two-lanes", "--workers", "2")) == 0  # reused
    for table in ("zero_shot.csv", "validation.csv", "routing.csv"):
        one, two = (comparison / d / table for d in ("one-lane", "two-lanes"))
        assert one.read_text() == two.read_text(), table


def test_the_default_lanes_are_the_usable_cores(monkeypatch):
    from repro.studies import engine as study

    monkeypatch.setattr(study.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert study.usable_cores() == 3
    assert mini.MiniConfig(runs=("switch",)).workers == 3 and mini.parse(["--runs", "switch"], "mini")[0].workers == 3


def test_jobs_start_longest_first_seed_by_seed(tmp_path):
    jobs = [("dense", 0), ("hash", 0), ("dirmoe", 0), ("new", 0), ("dense", 1), ("hash", 1), ("dirmoe", 1)]
    runs = [Run(f"{name}-s{k}", f"{name}-tiny", label=name, wave=k) for name, k in jobs]
    seconds = {"dense": 120.0, "dirmoe": 170.0, "hash": 150.0}
    assert [(r.label, r.wave) for r in longest_first(runs, seconds)] == [
        ("new", 0), ("dirmoe", 0), ("hash", 0), ("dense", 0), ("dirmoe", 1), ("hash", 1), ("dense", 1)]
    assert longest_first(runs, {}) == runs  # no figures: the given order
    # the figures come from the last comparison's summary in --out; none there (or unreadable): none
    assert previous_cpu_seconds(str(tmp_path)) == {}
    (tmp_path / "summary.json").write_text(json.dumps({"run_cpu_seconds": seconds}))
    assert previous_cpu_seconds(str(tmp_path)) == seconds
    # the mini comparison's runs: a row per router, a wave per seed
    study = mini.MiniConfig(runs=("dense", "hash"), seeds=2, out_dir=str(tmp_path)).study()
    assert [(r.run_id, r.label, r.wave) for r in study.runs] == [
        ("dense", "dense", 0), ("hash", "hash", 0), ("dense-s1", "dense", 1), ("hash-s1", "hash", 1)]


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ReproError, match="unknown run.*valid: dense, auxfree, dirmoe, "):
        mini.main(["--runs", "nope"])
    with pytest.raises(ReproError, match="Key .stepz. not in .RunConfig."):
        mini.main(["--set", "stepz=3"])


class _Request:
    """Stands in for lm-eval's Instance (the bridge reads ``.args``)."""

    def __init__(self, *args) -> None:
        self.args = args


def test_checkpoint_scoring_is_independent_of_batching(comparison):
    from repro.evaluation.harness import SuiteLM
    from repro.model.parallel import destroy_distributed
    from repro.training.inference import load_for_evaluation

    requests = [
        _Request("The licence grants the right to", " copy and modify the software."),
        _Request("def main():", "\n    return 0"),
        _Request("NAME\n       ls - list directory", " contents"),
    ]
    try:
        # Lory routes each request once on its prompt: padding and neighbours in the batch cannot matter.
        lory, tokenizer = load_for_evaluation(comparison / "runs" / "lory", device="cpu")
        batched = SuiteLM(model=lory, tokenizer=tokenizer, batch_size=3).loglikelihood(requests)
        alone = SuiteLM(model=lory, tokenizer=tokenizer, batch_size=1).loglikelihood(requests)
        assert [s for s, _ in batched] == pytest.approx([s for s, _ in alone], abs=1e-4)
        # Expert Choice couples the tokens of a batch: the bridge scores it one request at a time.
        ec, tokenizer = load_for_evaluation(comparison / "runs" / "expert_choice", device="cpu")
        assert ec.batch_coupled and not lory.batch_coupled
        assert SuiteLM(model=ec, tokenizer=tokenizer, batch_size=8).batch_size == 1
    finally:
        destroy_distributed()
