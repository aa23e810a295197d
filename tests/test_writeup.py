"""The result write-ups: generated from the results files, their words chosen by the tests, and the committed
README blocks and results/<study>/README.md files in step with the committed results."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest

from repro.__main__ import main as repro_main
from repro.errors import ReproError
from repro.report.verdicts import Paired, Writeup, paired_tests, verdict
from repro.studies import writeup
from repro.studies.writeup import fill_blocks

ROOT = Path(__file__).resolve().parents[1]


def test_committed_writeups_agree_with_the_results_files():
    """Every results/<study>/README.md and every README result block is what the generator makes of the files."""
    expected = writeup.targets(ROOT)
    assert ROOT / "README.md" in expected and len(expected) >= 5
    stale = [str(p.relative_to(ROOT)) for p, text in expected.items() if not p.is_file() or p.read_text() != text]
    assert not stale, f"out of date (run python -m repro report writeup): {stale}"


def test_the_readme_has_a_block_for_every_study():
    readme = (ROOT / "README.md").read_text()
    for study in writeup.writeups():
        if (ROOT / "results" / study).is_dir():
            assert f"<!-- BEGIN generated: {study} -->" in readme
            assert f"<!-- END generated: {study} -->" in readme


@pytest.mark.parametrize(
    ("p", "p_holm", "words"),
    [
        (0.001, 0.004, "lower, significant after Holm (p = 0.004)"),
        (0.026, 0.15, "lower before Holm's adjustment (raw p = 0.026) but not significantly after it (Holm p = 0.15)"),
        (0.3, 0.6, "not significant (raw p = 0.3, Holm p = 0.6); it would have found ±"),
        (None, None, "untested"),
    ],
)
def test_the_words_follow_the_test(p, p_holm, words):
    assert verdict(Paired(-0.5, -0.9, -0.1, p, p_holm, 6, 5)).startswith(words)


def test_a_null_says_what_its_test_could_have_found():
    """Not significant: the smallest difference its family's tests find with 80% power (stats decision 11), in
    the difference's units; a family out of reach says 'underpowered' instead of reading as a null."""
    from scipy import stats as sps

    from repro.stats import paired_detectable_effect

    p = Paired(-0.5, -0.9, -0.1, 0.3, 0.6, 6, 5, family=8)
    sd = 0.4 * 6**0.5 / float(sps.t.ppf(0.975, 5))
    assert p.sd == pytest.approx(sd)
    detectable = paired_detectable_effect(6, 8) * sd
    assert verdict(p) == (f"not significant (raw p = 0.3, Holm p = 0.6); it would have found ±{detectable:.2f} "
                          "with 80% power at 6 seeds and 8 tests")
    three = Paired(-0.5, -0.9, -0.1, 0.3, 0.6, 3, 2, family=8)
    assert three.underpowered and not p.underpowered
    assert verdict(three).endswith(f"underpowered: at 3 seeds and 8 tests, 80% power needs a difference of "
                                   f"{paired_detectable_effect(3, 8):.2g} standard deviations of the paired differences, "
                                   f"±{paired_detectable_effect(3, 8) * three.sd:.2f}")
    # The same numbers significant: no power words.
    assert "80% power" not in verdict(Paired(-0.5, -0.9, -0.1, 0.001, 0.004, 6, 6, family=8))


def test_a_hypothesis_significant_the_other_way_is_refuted_and_a_sign_flip_disagreement_is_shown():
    up = Paired(0.584, 0.278, 0.889, 0.004, 0.019, 6, 0, family=6, p_sign_flip_holm=0.19)
    assert verdict(up, expect="lower").startswith("refuted: predicted lower, came out higher, significant after Holm")
    assert not verdict(up, expect="higher").startswith("refuted") and not verdict(up).startswith("refuted")
    assert ("the exact sign-flip test does not confirm it (Holm p = 0.19; at 6 seeds it cannot go below 0.031), so "
            "this rests on the differences being normal") in verdict(up)
    assert "sign-flip" not in verdict(Paired(0.584, 0.278, 0.889, 0.004, 0.019, 6, 0, p_sign_flip_holm=0.03))
    page = next(w for w in writeup.generate(ROOT) if w.study == "dirmoe-ablation-confirm").readme
    assert "more than removing every aux term" in page and "refuted: predicted lower, came out higher" in page


def test_the_screen_of_three_seeds_reads_as_underpowered_not_as_a_list_of_nulls():
    block = next(w for w in writeup.generate(ROOT) if w.study == "dirmoe-ablation").block
    assert "in neither layer" not in block
    assert "the others are not evidence of no effect (at 3 seeds and 140 tests" in block and "underpowered" in block
    six = next(w for w in writeup.generate(ROOT) if w.study == "dirmoe-ablation-6seeds").block
    assert "in neither layer: recon-off and kl-off (at 6 seeds and 55 tests" in six


def test_a_loss_comparison_names_the_runs_of_unequal_compute(tmp_path):
    root = _copy_results(tmp_path, ("mini", "mini-seeds"))
    text = next(w for w in writeup.generate(root) if w.study == "mini-seeds").readme
    assert re.search(r"Unequal compute \(expert FLOPs per token against switch's, [^)]*\): [^\n]*remoe \+\d", text)
    summary_path = root / "results" / "mini-seeds" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["expert_flops_off_parity"] = {}  # every run at compute parity
    summary_path.write_text(json.dumps(summary))
    assert "Unequal compute" not in next(w for w in writeup.generate(root) if w.study == "mini-seeds").readme


def test_the_seed_summary_holds_what_its_records_give():
    """results/mini-seeds/summary.json's tests (the write-up's only source) are those the study computes from the
    records it keeps beside them: the zero-shot and routing comparisons over seeds and the first seed's parity."""
    from repro.records.store import load_record
    from repro.studies.mini import seed_comparisons, tested

    directory = ROOT / "results" / "mini-seeds"
    summary = json.loads((directory / "summary.json").read_text())
    runs, seeds = list(summary["per_seed"]), summary["seeds"]
    records = {(run, k): load_record(directory / "records" / f"{f'{run}-s{k}' if k else run}.record.json")
               for k in range(seeds) for run in runs}
    expected = json.loads(json.dumps(tested([records[(run, 0)] for run in runs], seed_comparisons(list(records.values())))))
    assert {key: summary[key] for key in expected} == expected
    assert summary["over_seeds"]["routing"]["cells"]["dirmoe"]["load imbalance"]["mean"] > 1


def test_the_layers_the_prose_names_are_the_routing_tables():
    """Layers are counted from 1 in the routing table, the logs and TensorBoard; the prose names them alike."""
    rows = list(csv.DictReader((ROOT / "results" / "mini" / "routing.csv").open()))
    layers = sorted({r["Layer"] for r in rows if r["Layer"] != "mean"})
    assert layers[0] == "1"
    page = next(w for w in writeup.generate(ROOT) if w.study == "mini").readme
    for named in re.findall(r"in layers ([\d, ]+)\)", page):
        assert named.split(", ") == layers, page


def test_the_seed_study_states_how_many_seeds_its_differences_need():
    """From the committed seeds' paired held-out differences: what 3, 6 and 10 seeds detect (falling with the
    seeds) and the 10-seed study's cost."""
    page = next(w for w in writeup.generate(ROOT) if w.study == "mini-seeds").readme
    match = re.search(r"reaches ±([\d.]+) at 3, ±([\d.]+) at 6, ±([\d.]+) at 10 seeds", page)
    assert match is not None, page
    at3, at6, at10 = map(float, match.groups())
    assert at3 > at6 > at10 > 0
    assert "`nox -s mini-power` trains 10 seeds" in page and "CPU-hours" in page


def test_the_direction_word_follows_the_sign():
    assert verdict(Paired(0.5, 0.1, 0.9, 0.001, 0.002, 6, 0)).startswith("higher")
    assert verdict(Paired(0.5, 0.1, 0.9, 0.001, 0.002, 6, 0), higher="slower").startswith("slower")


def test_paired_tests_compare_each_pair_with_holm_over_the_family():
    reference = {"1": 5.0, "2": 5.3, "3": 4.9, "4": 5.1, "5": 5.2, "6": 4.8}
    shifted = {s: v - 1.0 + 0.01 * int(s) for s, v in reference.items()}
    noise = {s: v + (0.05 if int(s) % 2 else -0.05) for s, v in reference.items()}
    constant = {s: v + 0.2 for s, v in reference.items()}
    others = {"shifted": shifted, "noise": noise, "constant": constant, "one": {"1": 1.0}}
    family = paired_tests({name: (reference, values) for name, values in others.items()})
    assert set(family) == {"shifted", "noise", "constant"}  # one shared seed: no test
    assert verdict(family["shifted"]).startswith("lower, significant after Holm")
    assert family["shifted"].n_lower == 6 and family["shifted"].n == 6
    assert family["shifted"].mean == pytest.approx(-1.0 + 0.035)
    assert family["shifted"].low < family["shifted"].mean < family["shifted"].high
    assert verdict(family["noise"]).startswith("not significant")
    assert family["shifted"].family == 2 and family["shifted"].p_sign_flip_holm == pytest.approx(min(1.0, 2 * 2 / 64))
    assert family["constant"].p is None and verdict(family["constant"]).startswith("untested")  # t = inf: undefined
    # Holm over the two defined tests: the larger raw p is at least its own value, the smaller doubled
    assert family["shifted"].p_holm == pytest.approx(min(1.0, 2 * family["shifted"].p))


def _copy_results(tmp_path: Path, studies: tuple[str, ...]) -> Path:
    for study in studies:
        shutil.copytree(ROOT / "results" / study, tmp_path / "results" / study, ignore=shutil.ignore_patterns("*.png", "*.tex"))
    return tmp_path


def test_a_changed_test_result_changes_the_words(tmp_path):
    """The validation-loss sentence reads its test from summary.json: a significant test there reads 'significant'."""
    root = _copy_results(tmp_path, ("dirmoe-ablation-6seeds",))
    summary_path = root / "results" / "dirmoe-ablation-6seeds" / "summary.json"
    before = writeup.generate(root)[0].block
    assert "higher before Holm's adjustment (raw p = 0.026)" in before and "switch lower in 5 of 6 seeds" in before
    summary = json.loads(summary_path.read_text())
    summary["results"]["paper"]["val_loss"]["vs_switch"]["p_holm"] = 0.01
    summary["results"]["paper"]["val_loss"]["values"]["4"] = 5.0  # paper below switch in seed 4 now
    summary_path.write_text(json.dumps(summary))
    after = writeup.generate(root)[0].block
    assert "paper minus switch: 0.075 [0.014, 0.136], higher, significant after Holm (p = 0.01)" in after
    assert "switch lower in 4 of 6 seeds" in after


def test_the_cell_against_cell_sentences_quote_the_pairs_table_and_its_family(tmp_path):
    """One family per comparison: the write-up's cell-against-cell p-values are those of the table it links."""
    root = _copy_results(tmp_path, ("dirmoe-ablation-6seeds",))
    study = root / "results" / "dirmoe-ablation-6seeds"
    written = writeup.generate(root)[0]
    assert "DirMoE ablation, cell against cell" in written.readme  # the table is on the page
    assert "Cell against cell (`ablation_pairs`, Holm over its 60 tests)" in written.block
    rows = {r["Cells"]: r for r in csv.DictReader((study / "ablation_pairs.csv").open())}
    for layer, column in ((1, "load imb. L1 diff"), (2, "load imb. L2 diff")):
        sentence = next(line for line in written.block.splitlines() if line.startswith(f"- Layer {layer},"))
        for pair, row in rows.items():
            if "recon-centered" not in pair:
                continue
            table_p = re.search(r"\(p=([^)]+)\)", row[column]).group(1)
            quoted = re.search(re.escape(pair.replace(" - ", " minus ")) + r": [^;]*?(?:Holm p = |after Holm \(p = )([^)]+)\)", sentence)
            assert quoted is not None and quoted.group(1) == table_p, (pair, layer)
    # The per-seed values decide the words: a large, consistent shift is significant after Holm over the table.
    summary = json.loads((study / "summary.json").read_text())
    values = summary["results"]["kl-off"]["load_imbalance[0]"]["values"]
    base = summary["results"]["recon-centered"]["load_imbalance[0]"]["values"]
    for seed in values:
        values[seed] = base[seed] - 1.0 - 0.01 * int(seed)
    (study / "summary.json").write_text(json.dumps(summary))
    assert "recon-centered minus kl-off: 1.03 [1.02, 1.05], higher, significant after Holm" in writeup.generate(root)[0].block


def test_the_confirmatory_page_shows_only_its_pre_registered_family():
    page = next(w for w in writeup.generate(ROOT) if w.study == "dirmoe-ablation-confirm").readme
    assert "the hypotheses stated before these seeds" in page  # the ablation_confirm table
    assert "Holm-adjusted over all" not in page and "cell against cell" not in page  # no table in another family


def test_no_cell_against_cell_test_without_its_table(tmp_path):
    """The pairs the summary records are the pairs table's rows; a study without that table records none."""
    root = _copy_results(tmp_path, ("dirmoe-ablation-6seeds",))
    study = root / "results" / "dirmoe-ablation-6seeds"
    summary = json.loads((study / "summary.json").read_text())
    rows = [tuple(r["Cells"].split(" - ")) for r in csv.DictReader((study / "ablation_pairs.csv").open())]
    assert [tuple(pair) for pair in summary["pairs"]] == rows and len(rows) == 10
    summary["pairs"] = []
    (study / "summary.json").write_text(json.dumps(summary))
    assert "Cell against cell" not in writeup.generate(root)[0].readme


def test_fill_blocks_replaces_only_the_blocks_bodies():
    text = "intro\n<!-- BEGIN generated: a -->\nold\n<!-- END generated: a -->\nkept 1.23\n"
    out = fill_blocks(text, [Writeup("a", "", "- new")])
    assert out == "intro\n<!-- BEGIN generated: a -->\n- new\n<!-- END generated: a -->\nkept 1.23\n"
    with pytest.raises(ReproError, match="'b'"):
        fill_blocks("<!-- BEGIN generated: b -->\n<!-- END generated: b -->\n", [Writeup("a", "", "x")])


def test_check_fails_on_a_stale_block_and_writing_fixes_it(tmp_path, capsys):
    root = _copy_results(tmp_path, ("mini", "bench"))
    readme = root / "README.md"
    readme.write_text("# x\n\n<!-- BEGIN generated: mini -->\n- hand-written: dirmoe is the same as switch\n<!-- END generated: mini -->\n")
    assert repro_main(["report", "writeup", "--root", str(root), "--check"]) == 1
    assert "out of date" in capsys.readouterr().out
    assert repro_main(["report", "writeup", "--root", str(root)]) == 0
    assert "hand-written" not in readme.read_text() and "unigram baseline" in readme.read_text()
    assert (root / "results" / "mini" / "README.md").is_file() and (root / "results" / "bench" / "README.md").is_file()
    assert repro_main(["report", "writeup", "--root", str(root), "--check"]) == 0


def test_the_iteration_ratio_carries_its_per_round_interval_where_the_run_recorded_one(tmp_path):
    """The interleaved benchmark's line quotes each run's per-round mean and 95% interval from the JSON, and
    leaves them out for a run that did not record them (benchmark files from before the intervals)."""
    from repro.studies.bench_writeup import _bench_file

    data = json.loads((ROOT / "results" / "bench" / "iteration.json").read_text())
    extra = next(b["extra_info"] for b in data["benchmarks"] if "dirmoe_over_switch" in b["extra_info"])
    extra["over_switch_per_round"]["dirmoe"].update(estimate=1.5, low=1.25, high=1.75)
    path = tmp_path / "iteration.json"
    path.write_text(json.dumps(data))
    line = next(f for f in _bench_file(path)[0] if "stepped in turn" in f)
    assert "per round 1.500, 95% CI 1.250 to 1.750)" in line
    assert line.count("95% CI") == len(extra["over_switch"])
    del extra["over_switch_per_round"]
    path.write_text(json.dumps(data))
    line = next(f for f in _bench_file(path)[0] if "stepped in turn" in f)
    assert "95% CI" not in line and f"{extra['dirmoe_over_switch']:.3f}" in line
