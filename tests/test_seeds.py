"""Uncertainty in the records and tables: range checks, per-question results, partial evaluations (``--limit``),
held-out loss per domain, the tables over seeds, and the mini comparison's seeds."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from pathlib import Path

import pytest
import torch
from scipy import stats as sps
from test_evaluation import EOD, TinyLM, _heldout, no_network, tokenizer  # noqa: F401 - fixtures
from test_report import ENV, _lm_eval, _record

from repro.cli import main as repro_main
from repro.errors import ReproError
from repro.records.run_record import DomainLoss, PartialTask, partial_tasks
from repro.records.store import load_record, make_record, with_lm_eval, write_record
from repro.report.seed_tables import compare_over_seeds, comparison_label, seed_zero_shot_table
from repro.report.table_core import PARTIAL, render
from repro.report.tables import (
    heldout_loss,
    routing_seed_comparison,
    routing_seed_table,
    validation_seed_table,
    validation_table,
    zero_shot_table,
)
from repro.stats import compact_per_question, holm, mcnemar_exact

# ---------------------------------------------------------------------------------------------- range checks


def _good(tmp_path: Path) -> Path:
    record = _record("r", "switch", scores={"piqa": (0.6, 0.61)}, validation_loss=4.5,
                     domain_losses=(DomainLoss("licenses", 4.0, 100),))
    return write_record(record, tmp_path / "record.json")


def _set_n_samples(data, effective=3, original=5):
    data["lm_eval"]["n-samples"] = {"piqa": {"original": original, "effective": effective}}


@pytest.mark.parametrize(
    "mutate, message",
    [
        # the users' examples: an accuracy of 7.5 (prints as 750.00), a negative iteration time
        (lambda d: d["lm_eval"]["results"]["piqa"].update({"acc,none": 7.5}),
         "field 'lm_eval.results.piqa.acc,none' = 7.5 is out of range (must be in [0, 1])"),
        (lambda d: d["efficiency"].update(iter_time_ms=-3.0),
         "field 'efficiency': iter_time_ms = -3.0 is out of range (must be > 0)"),
        (lambda d: d["efficiency"].update(tokens_per_s=0), "tokens_per_s = 0.0 is out of range (must be > 0)"),
        (lambda d: d["efficiency"].update(tflops_per_device_analytic=-1e-3), "tflops_per_device_analytic = -0.001"),
        (lambda d: d["efficiency"].update(num_devices=0), "num_devices = 0 is out of range (must be >= 1)"),
        (lambda d: d["efficiency"].update(peak_memory_bytes=-1), "peak_memory_bytes = -1 is out of range (must be >= 0)"),
        (lambda d: d["routing"][1].update(simpson=1.5), "field 'routing[1]': simpson = 1.5 is out of range (must be in [0, 1])"),
        (lambda d: d["routing"][0].update(active_experts=-0.5), "active_experts = -0.5 is out of range (must be >= 0)"),
        (lambda d: d["routing"][0].update(dropped_mass=1.2), "dropped_mass = 1.2 is out of range (must be in [0, 1])"),
        (lambda d: d["loss_curve"][0].update(step=-1), "field 'loss_curve[0]': step = -1 is out of range (must be >= 0)"),
        (lambda d: d["environment"].update(num_processes=0), "num_processes = 0 is out of range (must be >= 1)"),
        (lambda d: d.update(validation_loss=-0.5), "field 'validation_loss' = -0.5 is out of range (must be >= 0)"),
        (lambda d: d["lm_eval"]["results"]["piqa"].update({"acc_stderr,none": -0.1}), "acc_stderr,none' = -0.1"),
        (lambda d: d["lm_eval"]["results"]["piqa"].update({"perplexity,none": 0.5}), "(must be >= 1)"),
        (lambda d: _set_n_samples(d, effective=6), "effective = 6 exceeds original = 5"),
        (lambda d: d["domain_losses"][0].update(tokens=0), "field 'domain_losses[0]': tokens = 0 is out of range"),
        (lambda d: d["domain_losses"][0].update(loss=-1.0), "loss = -1.0 is out of range (must be >= 0)"),
        (lambda d: d["domain_losses"].append(dict(d["domain_losses"][0])), "names a domain twice"),
        (lambda d: d.update(per_question={"piqa": {"docs_sha256": "x", "acc": [1, 0, 2]}}),
         "field 'per_question.piqa'.acc[2] = 2 is out of range (must be in [0, 1])"),
        (lambda d: d.update(per_question={"piqa": {"docs_sha256": "x", "acc": [1, 0], "acc_norm": [1]}}),
         "its metrics list different numbers of questions"),
        (lambda d: (_set_n_samples(d), d.update(per_question={"piqa": {"docs_sha256": "x", "acc": [1, 0]}})),
         "2 questions, but lm-eval scored 3 (n-samples)"),
        (lambda d: d.update(partial=[{"task": "boolq", "limit": 3, "evaluated": 3, "available": 10}]),
         "task 'boolq' has no lm-eval result"),
        (lambda d: d.update(partial=[{"task": "piqa", "limit": 5, "evaluated": 5, "available": 5}]),
         "evaluated = 5 documents of 5 is not partial"),
    ],
)
def test_out_of_range_values_are_refused_naming_file_and_field(tmp_path, mutate, message):
    path = _good(tmp_path)
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ReproError) as info:
        load_record(path)
    text = str(info.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text
    assert repro_main(["report", "tables", str(path)]) == 2  # the CLI: one line, exit 2


def test_records_in_range_load_and_records_without_the_new_fields_still_load(tmp_path):
    path = _good(tmp_path)
    data = json.loads(path.read_text())
    for name in ("per_question", "partial", "domain_losses"):
        data.pop(name)
    path.write_text(json.dumps(data))
    old = load_record(path)
    assert old.per_question is None and old.partial == () and old.domain_losses == ()
    # the edges of each range are allowed
    edges = _record("e", "switch", scores={"piqa": (0.0, 1.0)}, stderr=0.0, validation_loss=0.0)
    assert edges.lm_eval["results"]["piqa"]["acc_norm,none"] == 1.0
    with pytest.raises(ValueError, match="simpson must be a finite number"):
        dataclasses.replace(edges.routing[0], simpson=math.nan)
    # float32 routing shares: 1 - sum(r) may round just below 0, a Simpson index just above 1
    assert dataclasses.replace(edges.routing[0], dropped_mass=-1e-7, simpson=1 + 1e-7).dropped_mass == -1e-7


# ---------------------------------------------------------------------------------------------- partial runs


def _limited(scores, effective, original, limit=8):
    results = _lm_eval(scores)
    results["config"] = {"limit": limit}
    results["n-samples"] = {t: {"original": original[t], "effective": effective[t]} for t in scores}
    return results


def test_partial_tasks_from_lm_evals_n_samples_and_limit():
    results = _limited({"piqa": (0.5, 0.5), "boolq": (0.6, None)}, {"piqa": 8, "boolq": 8}, {"piqa": 1838, "boolq": 8})
    # boolq has 8 documents: a limit of 8 cut nothing
    assert partial_tasks(results) == (PartialTask("piqa", 8.0, 8, 1838),)
    no_counts = {k: v for k, v in results.items() if k != "n-samples"}
    assert partial_tasks(no_counts) == (PartialTask("boolq", 8.0, None, None), PartialTask("piqa", 8.0, None, None))
    assert partial_tasks(_lm_eval({"piqa": (0.5, 0.5)})) == ()  # no limit: complete
    assert PartialTask("piqa", 8.0, 8, 1838).describe() == "piqa: 8 of 1838 documents"
    assert PartialTask("piqa", 0.1, None, None).describe() == "piqa: limit 0.1"


def test_partial_runs_are_marked_in_every_zero_shot_table():
    cont, last = "minipile_continuation", "minipile_lastword"
    counts = {cont: 175, last: 178}
    full = _record("f-switch", "switch", scores={cont: (0.25, 0.3), last: (0.125, None)})
    cut = make_record(run_id="c-dirmoe", router="dirmoe", model="tiny", config={"seed": 1}, environment=ENV,
                      lm_eval_results=_limited({cont: (0.3, 0.375), last: (0.15, None)}, {cont: 8, last: 178}, counts))
    assert cut.partial == (PartialTask(cont, 8.0, 8, 175),)
    table = zero_shot_table([full, cut])
    rows = {row[0]: row for row in table.rows}
    assert rows["dirmoe"][1:] == (f"37.50 ± 1.00{PARTIAL}", "15.00 ± 1.00", f"26.25 ± 0.71{PARTIAL}")
    assert PARTIAL not in "".join(rows["switch"])
    assert f"{PARTIAL}: scored on part of the task's documents" in table.caption
    assert "dirmoe (minipile_continuation: 8 of 175 documents)" in table.caption
    tex = render(table, "tex")
    assert "37.50 \\ensuremath{\\pm} 1.00\\ensuremath{^\\dagger}" in tex and PARTIAL not in tex
    assert re.search(r"\| {3,}37\.50 ± 1\.00† \|", render(table, "md"))  # still right-aligned as a number
    # a record written before the field (partial empty) is still marked from lm-eval's own counts
    older = dataclasses.replace(cut, partial=())
    assert zero_shot_table([older]).rows[0][1].endswith(PARTIAL)
    seeds = seed_zero_shot_table(compare_over_seeds([full, cut]))
    seed_rows = {row[0]: row for row in seeds.rows}
    assert seed_rows["dirmoe"][2].endswith(PARTIAL) and not seed_rows["dirmoe"][3].endswith(PARTIAL)
    assert "c-dirmoe (minipile_continuation: 8 of 175 documents)" in seeds.caption


def test_check_notes_partial_evaluations():
    from repro.report.check import check_against_run, render_report

    cont, last = "minipile_continuation", "minipile_lastword"
    cut = make_record(run_id="c", router="dirmoe", model="tiny", config={"seed": 1}, environment=ENV,
                      lm_eval_results=_limited({cont: (0.3, 0.375), last: (0.15, None)}, {cont: 8, last: 178},
                                               {cont: 175, last: 178}))
    full = make_record(run_id="f", router="dirmoe", model="tiny", config={"seed": 1}, environment=ENV,
                       lm_eval_results=_limited({cont: (0.3, 0.375), last: (0.15, None)}, {cont: 175, last: 178},
                                                {cont: 175, last: 178}))
    rows = {row.metric: row for row in check_against_run(cut, full).rows}
    assert rows[f"{cont}/acc"].note == f"partial evaluation: {cont}: 8 of 175 documents"
    assert rows[f"{last}/acc"].note == ""  # 178 of 178: complete
    assert "partial evaluation" in render_report(check_against_run(cut, full))
    # the other way round: the reference was cut, and the note says so
    rows = {row.metric: row for row in check_against_run(full, cut).rows}
    assert rows[f"{cont}/acc"].note == f"reference c: partial evaluation: {cont}: 8 of 175 documents"


# ---------------------------------------------------------------------------------------------- per question


def _samples(task, metric, scores):
    return [{"doc_id": i, "doc_hash": f"{task}-{i}", metric: float(s)} for i, s in enumerate(scores)]


def test_records_keep_per_question_results_and_tests_use_them():
    ref = [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    better = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0]
    records = []
    for run_id, router, scores in (("q-switch", "switch", ref), ("q-dirmoe", "dirmoe", better)):
        results = _lm_eval({"minipile_continuation": (0.2, statistics.fmean(scores))})
        results["samples"] = {"minipile_continuation": _samples("minipile_continuation", "acc_norm", scores)}
        records.append(make_record(run_id=run_id, router=router, model="tiny", config={"seed": 1},
                                   environment=ENV, lm_eval_results=results))
    switch = records[0]
    assert "samples" not in switch.lm_eval
    assert switch.per_question == compact_per_question({"minipile_continuation": _samples("minipile_continuation", "acc_norm", ref)})
    assert switch.per_question["minipile_continuation"]["acc_norm"] == ref
    # one seed per router: the records' own per-question results give McNemar's exact test over the questions
    comparison = compare_over_seeds(records)
    assert comparison.test == "questions"
    test = comparison.cells["dirmoe"]["minipile_continuation"].test
    assert test.test == "McNemar exact" and test.p_value == mcnemar_exact(ref, better).p_value
    assert comparison.significant("dirmoe", "minipile_continuation")


def test_with_lm_eval_replaces_results_and_checks_them():
    record = _record("w", "switch")
    results = _limited({"piqa": (0.5, 0.5)}, {"piqa": 3}, {"piqa": 1838}, limit=3)
    results["samples"] = {"piqa": _samples("piqa", "acc", [1, 0, 1])}
    updated = with_lm_eval(record, results)
    assert updated.per_question["piqa"]["acc"] == [1, 0, 1] and updated.partial == (PartialTask("piqa", 3.0, 3, 1838),)
    assert updated.loss_curve == record.loss_curve and "samples" not in updated.lm_eval
    bad = _lm_eval({"piqa": (1.5, 0.5)})
    with pytest.raises(ReproError, match=r"^x\.json: the top level: field 'lm_eval.results.piqa.acc,none' = 1.5"):
        with_lm_eval(record, bad, origin="x.json")


def test_eval_command_records_per_question_results_and_its_limit(tmp_path, tokenizer, monkeypatch, no_network, capsys):  # noqa: F811
    from repro.evaluation import harness

    model = TinyLM(tokenizer.get_vocab_size(), tokenizer.token_to_id(EOD)).eval()
    monkeypatch.setattr(harness, "load_scoring_model", lambda checkpoint_dir, device=None: (model, tokenizer))
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_0000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text("{}")
    write_record(_record("run", "switch"), run / "record.json")
    out = tmp_path / "eval.json"
    argv = ["eval", "--checkpoint", str(checkpoint), "--local-tasks", str(tmp_path / "tasks"),
            "--local-tasks-from", str(_heldout(tmp_path / "heldout.jsonl")), "--tasks", "minipile_continuation",
            "--limit", "3", "--out", str(out)]
    assert repro_main(argv) == 0
    written = json.loads(out.read_text())
    assert "samples" not in written and written["config"]["limit"] == 3
    record = load_record(run / "record.json")
    available = written["n-samples"]["minipile_continuation"]["original"]
    assert available > 3 and record.partial == (PartialTask("minipile_continuation", 3.0, 3, available),)
    scores = record.per_question["minipile_continuation"]
    assert len(scores["acc"]) == len(scores["acc_norm"]) == 3
    acc = written["results"]["minipile_continuation"]["acc,none"]
    assert statistics.fmean(scores["acc"]) == pytest.approx(acc)
    assert zero_shot_table([record]).rows[0][1].endswith(PARTIAL)

    # A quick partial look never replaces complete results: the record keeps them, the look stays in --out.
    complete = _record("run", "switch", scores={"minipile_continuation": (0.5, 0.5)})
    write_record(complete, run / "record.json")
    before = (run / "record.json").read_bytes()
    assert repro_main([*argv[:-1], str(tmp_path / "look.json")]) == 0
    assert "left " in capsys.readouterr().out and (run / "record.json").read_bytes() == before
    assert json.loads((tmp_path / "look.json").read_text())["config"]["limit"] == 3


# ---------------------------------------------------------------------------------------------- validation loss


def _val_record(run_id, router, seed, valid, domains, active=(1.0, 1.0)):
    return _record(run_id, router, seed=seed, active=active, validation_loss=valid,
                   domain_losses=tuple(DomainLoss(d, loss, n) for d, (loss, n) in domains.items()))


def test_validation_table_per_run():
    switch = _val_record("v-switch", "switch", 1, 5.0, {"licenses": (4.0, 300), "man_pages": (5.0, 100)})
    dense = _record("v-dense", "dense", validation_loss=5.2)  # no per-domain losses
    assert heldout_loss(switch) == pytest.approx((4.0 * 300 + 5.0 * 100) / 400)  # 4.25: token-weighted
    assert heldout_loss(dense) is None
    table = validation_table([switch, dense])
    assert table.headers == ("Router", "valid split", "held-out", "licenses", "man_pages")
    assert table.rows == (("dense", "5.200", "--", "--", "--"), ("switch", "5.000", "4.250", "4.000", "5.000"))
    assert "tokens scored: licenses 300, man_pages 100" in table.caption


def test_validation_and_routing_over_seeds_are_t_intervals_with_paired_marks():
    valid = {"switch": [5.00, 5.10, 5.05], "dirmoe": [4.80, 4.91, 4.84], "remoe": [5.02, 5.08, 5.10]}
    lic = {"switch": [4.0, 4.2, 4.1], "dirmoe": [4.1, 4.15, 4.3], "remoe": [4.0, 4.2, 4.1]}
    imbalance = {"switch": (1.5, 1.6, 1.55), "dirmoe": (6.0, 6.5, 6.2), "remoe": (1.52, 1.61, 1.5)}
    records = [
        dataclasses.replace(
            _val_record(f"{r}-s{s}", r, s, valid[r][i], {"licenses": (lic[r][i], 100)}),
            routing=tuple(dataclasses.replace(layer, load_imbalance=imbalance[r][i])
                          for layer in _record("x", r).routing),
        )
        for r in valid for i, s in enumerate((1, 2, 3))
    ]

    def cell(values, mark=""):
        mean = statistics.fmean(values)
        low, _ = sps.t.interval(0.95, df=len(values) - 1, loc=mean, scale=sps.sem(values))
        return f"{mean:.3f} ± {mean - low:.3f}{mark}"

    table = validation_seed_table(records)
    rows = {row[0]: row for row in table.rows}
    assert table.headers == ("Router", "seeds", "valid split", "held-out", "licenses")
    raw = {r: sps.ttest_rel(valid[r], valid["switch"]).pvalue for r in ("dirmoe", "remoe")}
    adjusted = dict(zip(raw, holm(list(raw.values()))))
    assert adjusted["dirmoe"] < 0.05 <= adjusted["remoe"]
    assert rows["switch (reference)"][1:3] == ("3", cell(valid["switch"]))
    assert rows["dirmoe"][2] == cell(valid["dirmoe"], "*") and rows["remoe"][2] == cell(valid["remoe"])
    assert rows["dirmoe"][3] == rows["dirmoe"][4] == cell(lic["dirmoe"])  # one domain: held-out = that domain
    assert "paired t-test over the seeds" in table.caption and "Holm" in table.caption

    routing = routing_seed_table(routing_seed_comparison(records))
    assert routing.headers == ("Router", "seeds", "active experts", "Simpson index", "load imbalance")
    rows = {row[0]: row for row in routing.rows}
    mean = statistics.fmean(imbalance["dirmoe"])
    half = sps.t.ppf(0.975, 2) * statistics.stdev(imbalance["dirmoe"]) / math.sqrt(3)
    assert rows["dirmoe"][4] == f"{mean:.2f} ± {half:.2f}*"  # two decimals, like the routing table
    assert rows["remoe"][4].endswith(f"{statistics.stdev(imbalance['remoe']) * sps.t.ppf(0.975, 2) / math.sqrt(3):.2f}")
    assert rows["dirmoe"][2] == "1.000 ± 0.000"  # identical over seeds: no spread, no test evidence
    # the dense baseline runs the model's dense counterpart: compared with the routers, another model is not
    dense = [_record(f"dense-s{k}", "dense", seed=k, model="tiny-dense", validation_loss=5.3) for k in (1, 2, 3)]
    with_dense = validation_seed_table(records + dense, family="column")
    assert with_dense.rows[1][:4] == ("dense", "3", "5.300 ± 0.000*", "--")  # after the reference, dense first
    # in the table's family (the default) its p = 0.013 does not survive the 8 tests of the table
    assert validation_seed_table(records + dense).rows[1][2] == "5.300 ± 0.000"
    with pytest.raises(ReproError, match=r"several models \(185m, tiny\)"):
        validation_seed_table(records + [_record("big", "switch", seed=9, model="185m-dense", validation_loss=3.0)])
    # one seed each: intervals undefined, no test
    single = validation_seed_table([r for r in records if r.run_id.endswith("-s1")])
    assert single.rows[0] == ("switch (reference)", "1", "5.000", "4.000", "4.000")
    assert "No significance test" in single.caption


def test_seed_tables_leave_a_constant_difference_unmarked_with_a_footnote():
    # two seeds, dirmoe exactly 10 points above switch on both: t = inf, p = 0 before; undefined now
    scores = {("switch", 1): 0.30, ("switch", 2): 0.35, ("dirmoe", 1): 0.40, ("dirmoe", 2): 0.45}
    records = [
        _record(f"{router}-s{seed}", router, seed=seed,
                scores={"minipile_continuation": (v, None), "minipile_lastword": (0.1 * seed + v / 7, None)})
        for (router, seed), v in scores.items()
    ]
    comparison = compare_over_seeds(records)
    cell = comparison.cells["dirmoe"]["minipile_continuation"]
    assert cell.undefined and not comparison.significant("dirmoe", "minipile_continuation")
    table = seed_zero_shot_table(comparison)
    row = {r[0]: r for r in table.rows}["dirmoe"]
    assert not row[2].endswith("*")
    assert "Test undefined" in table.caption and "dirmoe in Continuation (local)" in table.caption


def test_a_variant_is_compared_beside_its_router_not_as_its_seeds():
    """``dirmoe+centered-tiny`` runs are their own row: the same seeds as ``dirmoe-tiny`` are no clash."""
    def run(name, router, seed, valid, model="tiny"):
        return _record(f"{name}-s{seed}", router, seed=seed, model=model, validation_loss=valid,
                       experiment_name=f"{name}-{model.removesuffix('-dense')}")

    records = [run(n, n.partition("+")[0], s, v + s / 100)
               for n, v in (("switch", 5.0), ("dirmoe", 5.2), ("dirmoe+centered", 4.9)) for s in (1, 2, 3)]
    dense = run("dense", "dense", 1, 5.5, model="tiny-dense")
    assert [comparison_label(r) for r in (records[3], records[6], dense)] == ["dirmoe", "dirmoe+centered", "dense"]
    # an experiment named otherwise (a hand-made run) is compared under its router
    assert comparison_label(_record("my-run", "remoe")) == "remoe"
    table = validation_seed_table([*records, dense])
    assert [row[:2] for row in table.rows] == [
        ("switch (reference)", "3"), ("dense", "1"), ("dirmoe", "3"), ("dirmoe+centered", "3")]


# ---------------------------------------------------------------------------------------------- the mini's seeds


def test_mini_seed_zero_is_the_single_seed_run_and_seed_k_adds_k():
    from repro.config import apply_overrides
    from repro.experiments import get_experiment
    from repro.studies.mini import MiniConfig, parse

    cfg = MiniConfig(runs=("switch", "dense"), seeds=3, steps=5, data_dir="d", work_dir="w")
    today = apply_overrides(
        get_experiment("switch-tiny"), ["schedule.steps=5", "data.source=mini-pile:d", "model.backend=torch"]
    )
    assert cfg.experiment("switch") == today and cfg.experiment("switch", 0) == today
    assert cfg.experiment("switch", 2) == dataclasses.replace(today, seed=today.seed + 2)
    assert cfg.run_dir("switch") == Path("w/switch") and cfg.run_dir("switch", 2) == Path("w/switch-s2")
    assert cfg.jobs() == [("switch", 0), ("dense", 0), ("switch", 1), ("dense", 1), ("switch", 2), ("dense", 2)]
    reseeded = MiniConfig(runs=("switch",), seeds=2, overrides=("seed=7",), data_dir="d")
    assert (reseeded.experiment("switch").seed, reseeded.experiment("switch", 1).seed) == (7, 8)
    parsed, _ = parse(["--runs", "switch", "--seeds", "3"], "mini")
    assert parsed.seeds == 3 and parse(["--runs", "switch"], "mini")[0].seeds == 1
    with pytest.raises(ReproError, match="--seeds must be >= 1, got 0"):
        parse(["--seeds", "0"], "mini")


class _BigramLM:
    """Logits from a fixed table indexed by the current token: each prediction's loss is known in closed form."""

    def __init__(self, vocab: int) -> None:
        self.table_VV = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
        self.shapes: list[tuple[int, ...]] = []

    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(tokens_BS.shape))
        return self.table_VV[tokens_BS]


def test_heldout_domain_losses_against_a_direct_sum():
    from repro.studies.mini import heldout_domain_losses

    lm = _BigramLM(11)
    docs = [(list(range(10)), "a"), ([3, 4], "b"), ([5], "b"), ([1, 2, 3, 4, 5, 6, 7], "a"), ([9, 8, 7], "b")]
    losses = heldout_domain_losses(lm.logits, docs, seq_length=4, tokens_per_domain=7)
    log_p = torch.log_softmax(lm.table_VV.double(), -1)

    def nll(window):
        return -sum(float(log_p[a, b]) for a, b in zip(window, window[1:]))

    # "a": windows [0..3] (3 predictions), [4..7] (3: 6 < 7, go on), [8, 9] (1): 7 scored, stop before doc 4.
    a = nll([0, 1, 2, 3]) + nll([4, 5, 6, 7]) + nll([8, 9])
    # "b": [3, 4] (1), [5] alone predicts nothing, [9, 8, 7] (2)
    b = nll([3, 4]) + nll([9, 8, 7])
    assert [d.domain for d in losses] == ["a", "b"]
    assert (losses[0].tokens, losses[1].tokens) == (7, 3)
    assert losses[0].loss == pytest.approx(a / 7, rel=1e-12) and losses[1].loss == pytest.approx(b / 3, rel=1e-12)
    assert all(shape[0] == 1 and shape[1] <= 4 for shape in lm.shapes)  # one window per forward
