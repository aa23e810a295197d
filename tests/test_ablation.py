"""The DirMoE ablation: its cells, the end-of-run metrics and their statistics against the reference formulas,
and ``python -m repro study ablation`` end to end at a few steps (2 cells x 2 seeds): tables, plots and summary from
the runs, reuse of finished runs, resume of a killed run, one-line errors, foreign directories left alone."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
from scipy import stats as sps

from repro.errors import ReproError
from repro.records.step_log import LogRow, read_rows
from repro.report.ablation_tables import (
    Hypothesis,
    ablation_difference_table,
    ablation_table,
    collect_results,
    compare_cell_pairs,
    compare_cells,
    confirm_table,
    pairs_table,
    run_metrics,
)
from repro.report.table_core import PLUS_MINUS, render
from repro.studies import ablation

CELLS = "paper,recon-centered"
STEPS = 6


def _row(step: int, lm_loss: float, imbalance: list[float], weight_share: list[list[float]] | None = None,
         val: float | None = None, **scalars: list[float]) -> LogRow:
    routing = {"load_imbalance": imbalance, **scalars}
    per_expert = {"weight_share": weight_share} if weight_share is not None else {}
    return LogRow(step=step, loss=lm_loss, lm_loss=lm_loss, lr=1e-3, grad_norm=1.0, iter_time_s=0.1,
                  tokens_per_s=1.0, consumed_samples=8 * step, peak_memory_bytes=0, routing=routing,
                  routing_per_expert=per_expert, val_loss=val)


# ------------------------------------------------------------------------------------------------ cells
def test_cells_build_valid_configs_with_their_options():
    cfg = ablation.AblationConfig(cells=tuple(ablation.CELLS))
    assert len(cfg.cells) == 16 and ablation.REFERENCE in cfg.cells and ablation.SWITCH in cfg.cells
    for cell in cfg.cells:
        config = cfg.experiment(cell, 7)
        assert config.seed == 7 and config.schedule.steps == 600 and config.router.name == ablation.CELLS[cell].router
        assert config.name == f"ablation-{cell}"
    options = {c: cfg.experiment(c, 1).router.options for c in cfg.cells}
    assert options["paper"] == {} and options[ablation.SWITCH] == {}
    assert options["aux-off"] == {"recon_weight": 0.0, "kl_weight": 0.0, "sparsity_weight": 0.0}
    assert options["recon-centered"] == {"recon_target": "centered"}
    assert options["dense-first"] == {"dense_steps": 100}  # the first sixth of 600 steps
    assert options["tau-short"] == {"tau_schedule_steps": 60}  # the "short" preset: a tenth of the run
    assert options["switch-no-balance"] == {"aux_loss_coeff": 0.0}
    assert options["dirmoe-balance"] == {"balance_loss_coeff": 0.01}
    assert ablation.CELLS["tau-short"].router_options(4) == ("tau_schedule_steps=1",)  # never below 1


def test_config_refuses_bad_settings_listing_valid_values():
    with pytest.raises(ValueError, match="unknown cell.*nope.*valid: paper, recon-centered"):
        ablation.AblationConfig(cells=("paper", "nope"))
    with pytest.raises(ValueError, match="seeds must be distinct"):
        ablation.AblationConfig(cells=("paper",), seeds=(1, 1))
    with pytest.raises(ValueError, match="final_fraction"):
        ablation.AblationConfig(cells=("paper",), final_fraction=0)
    assert ablation.AblationConfig(cells=("paper",), steps=600).final_window == 60
    assert ablation.AblationConfig(cells=("paper",), steps=4).final_window == 1


# ---------------------------------------------------------------------------------------- run metrics
def test_run_metrics_follow_their_definitions():
    shares = [[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25]]
    rows = [
        _row(1, 9.0, [9.0, 9.0], [[1, 0, 0, 0], [1, 0, 0, 0]], val=9.5, active_experts=[3.0, 3.0]),
        _row(2, 4.0, [2.0, 4.0], shares, simpson_theta=[0.2, 0.4], active_experts=[1.0, 2.0]),
        _row(3, 2.0, [3.0, 6.0], shares, val=2.5, simpson_theta=[0.6, 0.8], active_experts=[1.0, 1.0]),
    ]
    m = run_metrics(rows, final_window=2)
    assert m["load_imbalance[0]"] == pytest.approx(2.5) and m["load_imbalance[1]"] == pytest.approx(5.0)
    # max / mean over experts of the mean weight: E * max / sum.
    assert m["weight_imbalance[0]"] == pytest.approx(4 * 0.5 / 1.0) and m["weight_imbalance[1]"] == pytest.approx(1.0)
    assert m["simpson_theta"] == pytest.approx(statistics.fmean([0.3, 0.7]))
    assert m["active_experts"] == pytest.approx(statistics.fmean([1.5, 1.0]))
    assert m["val_loss"] == 2.5 and m["lm_loss"] == pytest.approx(3.0)
    assert m["simpson_r"] is None and m["fallback_share"] is None  # not reported: missing, not zero
    switch_like = run_metrics([_row(1, 5.0, [2.0, 3.0])], final_window=10)
    assert switch_like["weight_imbalance[0]"] is None and switch_like["val_loss"] is None


def _results(values: dict[str, dict[int, float]]):
    logs = {cell: {seed: [_row(1, v, [v, v])] for seed, v in seeds.items()} for cell, seeds in values.items()}
    return collect_results(logs, final_window=1, readings={c: f"cell {c}" for c in values})


def test_intervals_paired_tests_and_holm_against_scipy():
    values = {
        "paper": {1: 6.0, 2: 7.0, 3: 6.5},
        "a": {1: 3.0, 2: 3.1, 3: 2.9},  # far below, consistently
        "b": {1: 6.2, 2: 6.7, 3: 6.9},  # within noise
        "c": {1: 5.0, 2: 6.8, 3: 5.5},
    }
    results = _results(values)
    stats = compare_cells(results, "paper", family="column")
    key = "load_imbalance[0]"
    raw = {}
    for cell, seeds in values.items():
        x = np.array([seeds[s] for s in (1, 2, 3)])
        low, high = sps.t.interval(0.95, 2, loc=x.mean(), scale=sps.sem(x))
        stat = stats[cell][key]
        assert stat.interval.estimate == pytest.approx(x.mean())
        assert (stat.interval.low, stat.interval.high) == pytest.approx((low, high))
        if cell == "paper":
            assert stat.test is None and stat.adjusted_p is None
            continue
        ref = np.array([values["paper"][s] for s in (1, 2, 3)])
        expected = sps.ttest_rel(x, ref)
        assert stat.test.p_value == pytest.approx(expected.pvalue)
        assert stat.difference.estimate == pytest.approx((x - ref).mean())
        raw[cell] = expected.pvalue
    # Holm by hand: sorted p-values times (m - rank), made monotone.
    order = sorted(raw, key=raw.get)
    running, holm = 0.0, {}
    for rank, cell in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * raw[cell]))
        holm[cell] = running
    for cell in raw:
        assert stats[cell][key].adjusted_p == pytest.approx(holm[cell])
    # the default family is the whole table: every defined test of every column, adjusted together
    whole = compare_cells(results, "paper")
    tested = {(c, k): s.test.p_value for c, cells in whole.items() for k, s in cells.items() if s.test is not None}
    assert len(tested) > len(raw)  # more columns than the one checked above
    adjusted = dict(zip(tested, _holm(list(tested.values()))))
    for (cell, k), p in adjusted.items():
        assert whole[cell][k].adjusted_p == pytest.approx(p)
    assert "Holm-adjusted over all" in ablation_table(results, reference="paper").caption
    table = ablation_table(results, reference="paper", family="column")
    assert "family: a column" in table.caption
    by_cell = {row[0]: row for row in table.rows}
    column = table.headers.index("load imb. L1")
    assert by_cell["a"][column].endswith("*") and not by_cell["b"][column].endswith("*")
    assert by_cell["paper (reference)"][column] == f"6.50 {PLUS_MINUS} {stats['paper'][key].interval.half_width:.2f}"
    diff = ablation_difference_table(results, reference="paper", family="column")
    assert [row[0] for row in diff.rows] == ["a", "b", "c"] and "p=" in diff.rows[0][1]
    assert diff.rows[0][1].endswith("*") and f"(p={holm['a']:.2g})" in diff.rows[0][1]
    for fmt in ("md", "csv", "tex"):
        assert "paper" in render(table, fmt)


def _holm(p):
    order = sorted(range(len(p)), key=p.__getitem__)
    out, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def test_a_constant_difference_is_undefined_not_significant_in_every_table():
    # "a" is exactly 1.0 below the reference on both seeds: t would be -inf, p = 0
    results = _results({"paper": {1: 6.0, 2: 7.0}, "a": {1: 5.0, 2: 6.0}, "b": {1: 6.5, 2: 6.6}})
    stat = compare_cells(results, "paper")["a"]["load_imbalance[0]"]
    assert stat.undefined and stat.adjusted_p is None and not stat.significant(0.05)
    assert stat.difference.estimate == pytest.approx(-1.0)
    table = ablation_table(results, reference="paper")
    column = table.headers.index("load imb. L1")
    row = {r[0]: r for r in table.rows}["a"]
    assert not row[column].endswith("*") and "Test undefined" in table.caption and "a in load imb. L1" in table.caption
    diff = ablation_difference_table(results, reference="paper")
    assert "p undefined" in {r[0]: r for r in diff.rows}["a"][1] and "Test undefined" in diff.caption
    pairs = pairs_table(results, [("a", "b")])
    assert pairs.rows[0][0] == "a - b" and "family: the table" in pairs.caption


def test_cell_against_cell_is_paired_over_shared_seeds_in_one_family():
    values = {
        "paper": {1: 6.0, 2: 7.0, 3: 6.5, 4: 6.6},
        "a": {1: 3.0, 2: 3.1, 3: 2.9, 4: 3.3},
        "b": {1: 4.0, 2: 4.4, 3: 4.1, 4: 4.2},
        "c": {1: 3.1, 2: 3.0, 3: 3.2},  # one seed fewer: paired over the three it shares
    }
    results = _results(values)
    pairs = [("a", "b"), ("a", "c")]
    stats = compare_cell_pairs(results, pairs, ["load_imbalance[0]"])
    ab, ac = stats[("a", "b", "load_imbalance[0]")], stats[("a", "c", "load_imbalance[0]")]
    expected_ab = sps.ttest_rel([3.0, 3.1, 2.9, 3.3], [4.0, 4.4, 4.1, 4.2])
    expected_ac = sps.ttest_rel([3.0, 3.1, 2.9], [3.1, 3.0, 3.2])
    assert ab.test.p_value == pytest.approx(expected_ab.pvalue) and ab.test.n == 4
    assert ac.test.p_value == pytest.approx(expected_ac.pvalue) and ac.test.n == 3
    assert ab.difference.estimate == pytest.approx(-1.1) and ac.test.statistic == pytest.approx(expected_ac.statistic)
    holm = _holm([expected_ab.pvalue, expected_ac.pvalue])
    assert (ab.adjusted_p, ac.adjusted_p) == pytest.approx(tuple(holm))
    table = pairs_table(results, pairs, keys=["load_imbalance[0]"])
    assert [r[0] for r in table.rows] == ["a - b", "a - c"] and table.rows[0][1].endswith("*")
    assert "Holm-adjusted over all 2 tests" in table.caption


def test_confirmatory_table_tests_the_stated_hypotheses_alone_in_one_family():
    values = {"paper": {7: 6.0, 8: 7.0, 9: 6.5}, "recon-centered": {7: 3.0, 8: 3.1, 9: 2.9}, "b": {7: 6.2, 8: 6.7, 9: 6.9}}
    results = _results(values)
    hypotheses = [Hypothesis("recon-centered", "paper", "load_imbalance[0]", "centred lowers L1"),
                  Hypothesis("b", "paper", "load_imbalance[0]", "b changes L1"),
                  Hypothesis("recon-centered", "kl-off", "load_imbalance[0]", "more than the KL")]
    table = confirm_table(results, hypotheses)
    raw = [sps.ttest_rel([3.0, 3.1, 2.9], [6.0, 7.0, 6.5]).pvalue, sps.ttest_rel([6.2, 6.7, 6.9], [6.0, 7.0, 6.5]).pvalue]
    adjusted = _holm(raw)  # the family: the two hypotheses whose cells ran, nothing else of the table
    assert [row[1] for row in table.rows] == ["recon-centered - paper", "b - paper"]
    assert f"(p={adjusted[0]:.2g})*" in table.rows[0][3] and f"(p={adjusted[1]:.2g})" in table.rows[1][3]
    assert "Holm-adjusted over the 2 hypotheses" in table.caption and "(7, 8, 9)" in table.caption
    assert "Not tested (a cell not run): recon-centered - kl-off (load imb. L1)" in table.caption
    assert {h.cell for h in ablation.HYPOTHESES} | {h.versus for h in ablation.HYPOTHESES} <= set(ablation.CELLS)


def test_unpaired_seeds_are_not_tested():
    results = _results({"paper": {1: 6.0, 2: 7.0}, "a": {3: 3.0, 4: 3.1}})
    stat = compare_cells(results, "paper")["a"]["load_imbalance[0]"]
    assert stat.test is None and stat.adjusted_p is None and stat.interval.n == 2


# ------------------------------------------------------------------------------------------ end to end
def test_the_pairs_table_rows_are_every_two_dirmoe_cells_besides_paper_up_to_its_bound():
    cells = ("paper", "recon-centered", "kl-off", "aux-off", "switch")
    assert ablation.cell_pairs(cells) == [("recon-centered", "kl-off"), ("recon-centered", "aux-off"), ("kl-off", "aux-off")]
    assert ablation.cell_pairs(cells, confirm=True) == []  # a confirmatory study tests its hypotheses alone
    assert ablation.cell_pairs(("paper", "recon-centered", "switch")) == []
    many = tuple(c for c, cell in ablation.CELLS.items() if cell.router == "dirmoe")
    assert len(many) - 1 > ablation.MAX_PAIRED_CELLS and ablation.cell_pairs(many) == []


def _argv(root, *extra: str, work: str = "runs", out: str = "out", cells: str = CELLS, seeds: str = "1,2"):
    # The data: the run's shared mini-pile (conftest), named in root/data-dir by the ``session`` fixture.
    argv = ["--cells", cells, "--seeds", seeds, "--steps", str(STEPS)]
    argv += ["--data-dir", (root / "data-dir").read_text(), "--work-dir", str(root / work), "--out", str(root / out)]
    # One validation micro-batch, not the ablation's eight: the loss is there, on less text.
    sets = ("validation.interval=3", "validation.iters=1", "checkpoint.interval=3")
    return [*argv, *(a for item in sets for a in ("--set", item)), *extra]


@pytest.fixture(scope="module")
def session(tmp_path_factory, mini_pile):
    root = tmp_path_factory.mktemp("ablation")
    (root / "data-dir").write_text(str(mini_pile))
    assert ablation.main(_argv(root)) == 0
    return root


@pytest.mark.slow
def test_tables_plots_and_summary_come_from_the_runs(session):
    out = session / "out"
    for table in ("ablation", "ablation_differences"):
        for fmt in ("md", "csv", "tex"):
            assert (out / f"{table}.{fmt}").is_file(), f"{table}.{fmt}"
    assert not (out / "ablation_vs_switch.md").exists()  # switch is not among the cells
    for plot in ("expert_load", "shared_mean", "simpson_theta", "summary"):
        assert (out / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [1, 2] and summary["steps"] == STEPS and summary["final_window_steps"] == 1
    assert summary["cells"]["recon-centered"]["options"] == ["recon_target=centered"]
    assert summary["cost"]["runs_measured"] == summary["cost"]["runs"] > 0 and "training" not in summary
    assert summary["pairs"] == [] and not (out / "ablation_pairs.md").exists()  # one DirMoE cell besides paper
    # The interval and the paired test, recomputed from the logs.
    key = "load_imbalance[1]"
    per_cell = {}
    for cell in ("paper", "recon-centered"):
        per_cell[cell] = [read_rows(session / "runs" / f"{cell}-s{s}")[-1].routing["load_imbalance"][1] for s in (1, 2)]
        entry = summary["results"][cell][key]
        assert [entry["values"][s] for s in ("1", "2")] == pytest.approx(per_cell[cell])
        x = np.array(per_cell[cell])
        assert entry["mean"] == pytest.approx(x.mean())
        assert entry["ci95"] == pytest.approx(list(sps.t.interval(0.95, 1, loc=x.mean(), scale=sps.sem(x))))
    versus = summary["results"]["recon-centered"][key]["vs_paper"]
    assert versus["p"] == pytest.approx(sps.ttest_rel(per_cell["recon-centered"], per_cell["paper"]).pvalue)
    # the family is the whole table against paper: every column's test of recon-centered
    family = {k: v["vs_paper"]["p"] for k, v in summary["results"]["recon-centered"].items()
              if k != "seeds" and v["vs_paper"] is not None and v["vs_paper"]["p"] is not None}
    assert len(family) > 1 and summary["family"] == "table"
    assert versus["p_holm"] == pytest.approx(dict(zip(family, _holm(list(family.values()))))[key])
    md = (out / "ablation.md").read_text()
    assert "paper (reference)" in md and "| 1,2 " in md
    mean, half = summary["results"]["paper"][key]["mean"], np.diff(summary["results"]["paper"][key]["ci95"])[0] / 2
    assert f"{mean:.2f} {PLUS_MINUS} {half:.2f}" in md
    # Every run's log reached the last step, with its seed and the cell's options.
    config = json.loads((session / "runs" / "recon-centered-s2" / "config.json").read_text())["experiment"]
    assert config["seed"] == 2 and config["router"]["options"] == {"recon_target": "centered"}
    assert len(read_rows(session / "runs" / "recon-centered-s2")) == STEPS


@pytest.mark.slow
def test_tables_only_rebuilds_the_tables_from_the_summary_alone(session, tmp_path):
    import shutil

    copy = tmp_path / "out"
    shutil.copytree(session / "out", copy)  # no run directories next to it: the summary is all it has
    tables = sorted(p.name for p in copy.glob("ablation*"))
    before = {name: (copy / name).read_text() for name in tables}
    for name in tables:
        (copy / name).unlink()
    assert ablation.main(["--tables-only", "--out", str(copy)]) == 0
    assert {name: (copy / name).read_text() for name in tables} == before
    with pytest.raises(ReproError, match=r"screen's seeds \[1, 2\] cannot confirm"):
        ablation.main(["--tables-only", "--confirm", "--out", str(copy)])
    with pytest.raises(ReproError, match="no ablation summary"):
        ablation.main(["--tables-only", "--out", str(tmp_path / "nothing")])


@pytest.mark.slow
def test_reruns_reuse_finished_runs(session, capsys):
    log = session / "runs" / "paper-s1" / "log.jsonl"
    before = log.stat().st_mtime_ns
    assert ablation.main(_argv(session, out="out2")) == 0
    printed = capsys.readouterr().out
    assert "reusing finished runs: paper-s1, recon-centered-s1, paper-s2, recon-centered-s2" in printed
    assert "training 0 runs" in printed
    assert log.stat().st_mtime_ns == before
    assert (session / "out" / "ablation.csv").read_text() == (session / "out2" / "ablation.csv").read_text()


@pytest.mark.slow
def test_a_killed_run_resumes_where_it_stopped(session, capsys):
    """A run stopped after step 4 (checkpoint at 3) resumes from step 3 and ends where the uninterrupted run
    of the same cell and seed ended."""
    import torch

    from repro.io_utils import claim_run_dir
    from repro.studies.engine import run_state
    from repro.training.trainer import train

    cfg, _ = ablation.parse(_argv(session, work="killed", cells="paper", seeds="1"), "test")
    run_dir = cfg.run_dir("paper", 1)
    claim_run_dir(run_dir, marker=cfg.study().markers[0], owner="the DirMoE ablation", command=ablation.COMMAND)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers
    try:
        assert train(cfg.experiment("paper", 1), run_dir, progress=False, stop_after=4)["stopped_at"] == 4
    finally:
        torch.set_num_threads(threads)
    first_rows = read_rows(run_dir)[:3]
    assert run_state(cfg.study(), cfg.run("paper", 1)) == "resume"
    assert ablation.main(_argv(session, work="killed", out="out-killed", cells="paper", seeds="1")) == 0
    assert "resuming unfinished runs: paper-s1" in capsys.readouterr().out
    rows = read_rows(run_dir)
    assert [r.step for r in rows] == list(range(1, STEPS + 1))
    assert [r.iter_time_s for r in rows[:3]] == [r.iter_time_s for r in first_rows]  # kept, not retrained
    uninterrupted = read_rows(session / "runs" / "paper-s1")
    assert [r.lm_loss for r in rows] == pytest.approx([r.lm_loss for r in uninterrupted], rel=1e-6)
    sessions = json.loads((session / "killed" / "sessions.json").read_text())
    assert sessions[-1]["resumed"] == ["paper-s1"] and sessions[-1]["trained"] == []


@pytest.mark.slow
def test_a_directory_it_did_not_create_is_refused_and_left_alone(session):
    foreign = session / "foreign" / "paper-s1"
    foreign.mkdir(parents=True)
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(ReproError, match="paper-s1: exists and was not created by the DirMoE ablation"):
        ablation.main(_argv(session, work="foreign", out="out-foreign"))
    assert (foreign / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in (session / "foreign").iterdir()) == ["paper-s1"]  # nothing else was started
    assert not (session / "out-foreign").exists()


def test_an_output_directory_of_another_command_is_refused_before_any_work(session):
    other = session / "other-results"
    other.mkdir()
    (other / "summary.json").write_text('{"another": "command"}')
    with pytest.raises(ReproError, match="other-results: exists and was not written by python -m repro study ablation"):
        ablation.main(_argv(session, work="never-made", out="other-results"))
    assert (other / "summary.json").read_text() == '{"another": "command"}' and not (session / "never-made").exists()


def test_bad_arguments_are_one_line_errors(capsys):
    from repro.cli import main as cli_main

    with pytest.raises(ReproError, match=r"--cells: unknown cell 'nope'; valid: paper, recon-centered, ") as exc:
        ablation.main(["--cells", "paper,nope"])
    assert "\n" not in str(exc.value) and "switch-no-balance" in str(exc.value)
    assert cli_main(["study", "ablation", "--cells", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --cells: unknown cell 'nope'; valid: paper,") and "\n" not in err
    assert cli_main(["study", "ablation", "--cells", "papr"]) == 2
    assert "unknown cell 'papr'; did you mean 'paper'?" in capsys.readouterr().err
    with pytest.raises(ReproError, match="--seeds: expected comma-separated integers"):
        ablation.main(["--seeds", "1,x"])
    with pytest.raises(ReproError, match="seeds must be distinct"):
        ablation.main(["--seeds", "1,1"])
    with pytest.raises(ReproError, match=r"confirmatory study needs seeds outside the screen's .* got \[6\]"):
        ablation.main(["--confirm", "--seeds", "6,7,8"])
    with pytest.raises(ReproError, match="Key .stepz. not in .RunConfig."):
        ablation.main(["--cells", "paper", "--set", "stepz=3"])
