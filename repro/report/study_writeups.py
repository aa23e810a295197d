"""The findings of each study, as sentences built from its results files (:mod:`repro.report.writeup`).

One function per kind of study directory: it reads the directory's files, and returns the study's page and its
README block. Numbers are formatted from the files; comparison words come from :func:`prose.verdict` (or,
for a table's marks, from the mark the table's own test set).

The ablation's ``summary.json`` holds every cell's per-seed values and its paired comparisons with the paper's
DirMoE and with Switch (the tests behind the tables' marks); those are read, not recomputed. A cell against
another is quoted only from the cell-against-cell table, ``ablation_pairs``, in that table's family
(docs/evaluation.md: one family per comparison).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from repro.report.ablation_tables import REFERENCE, SWITCH, compare_cell_pairs, difference_metrics, results_from_json
from repro.report.verdicts import (
    ALPHA,
    UNDERPOWERED_EFFECT,
    Paired,
    Writeup,
    cell_half_width,
    cell_marked,
    cell_value,
    compared,
    link,
    listing,
    load_json,
    num,
    page,
    paired,
    paired_tests,
    plots,
    read_rows,
    verdict,
    with_sign_flip,
)
from repro.stats import paired_detectable_effect

REFERENCE_ROUTER = "switch"


def _mean_rows(directory: Path, name: str) -> dict[str, dict[str, str]]:
    """Router -> row of a per-router table (the ``mean`` layer row where the table has layers)."""
    rows = read_rows(directory / name)
    return {r["Router"].split(" (")[0]: r for r in rows if r.get("Layer", "mean") == "mean"}


def _cpu(cpu: dict[str, float]) -> str:
    return (
        f"Each run took {num(min(cpu.values()), '.0f')} to {num(max(cpu.values()), '.0f')} CPU-seconds "
        f"({num(sum(cpu.values()), '.0f')} for the {len(cpu)} runs; `run_cpu_seconds`)."
    )


def _wall(summary: dict[str, Any], runs: int) -> str:
    """What the invocation that wrote the summary of ``runs`` runs cost in wall time ('' where it does not say)."""
    wall, trained = summary.get("wall_seconds"), summary.get("trained_runs")
    if wall is None or trained is None:
        return ""
    reused = f", reusing the other {runs - len(trained)}" if len(trained) < runs else ""
    return (f"The invocation that wrote these files took {num(wall / 60, '.1f')} min of wall time and trained "
            f"{len(trained)} of the {runs} runs{reused} (`wall_seconds`, `trained_runs`).")


def _expert_flops(efficiency_csv: Path) -> dict[str, float]:
    """Router -> its expert FLOPs per token relative to the reference router's, for the routers the efficiency
    table marks as off compute parity (its ``compute parity`` column: ``NO (+30.9% vs switch, ...)``); empty
    where there is no such table."""
    if not efficiency_csv.is_file():
        return {}
    out = {}
    for row in read_rows(efficiency_csv):
        match = re.match(r"NO \(([-+]\d+(?:\.\d+)?)%", row.get("compute parity", ""))
        if match:
            out[row["Router"].split(" (")[0]] = float(match.group(1)) / 100
    return out


def _compute_note(compute: dict[str, float], router: str) -> str:
    """`` (+30.9% expert FLOPs)`` beside a router of unequal compute, '' otherwise."""
    return f" ({100 * compute[router]:+.1f}% expert FLOPs)" if router in compute else ""


def family_power(n: int, tests: int) -> str:
    """``at 3 seeds and 8 tests, 80% power at Holm's first step needs a difference of 9.3 standard deviations of
    the paired differences`` with ``: underpowered`` where it exceeds :data:`UNDERPOWERED_EFFECT`."""
    effect = paired_detectable_effect(n, max(1, tests))
    text = (f"at {n} seeds and {tests} tests, 80% power at Holm's first step needs a difference of {effect:.2g} "
            "standard deviations of the paired differences")
    return text + (": underpowered" if effect > UNDERPOWERED_EFFECT else "")


# ------------------------------------------------------------------------------------------ mini
def mini(directory: Path) -> Writeup:
    """``results/mini``: one seed of every router (no tests possible; the seeds study has them)."""
    s = load_json(directory / "summary.json")
    final, unigram = s["final_train_lm_loss_last10"], s["unigram_loss"]
    heldout, spec = s["heldout_loss"], s.get("specialisation_score", {})
    routing = _mean_rows(directory, "routing.csv")
    layers = [r for r in read_rows(directory / "routing.csv") if r.get("Layer") != "mean"]
    above = [r for r, v in final.items() if v >= unigram]
    runs_text = ", ".join(f"{r} {num(v)}" for r, v in final.items())
    first = (
        f"Every run's final training LM loss (mean of the last 10 steps) is below the unigram baseline "
        f"({num(unigram)} nats/token): {runs_text}."
        if not above else f"Runs at or above the unigram baseline ({num(unigram)}): {listing(above)}. All: {runs_text}."
    )
    order = sorted(heldout, key=heldout.get)
    imbalance = {r: cell_value(row.get("load imbalance", "")) for r, row in routing.items()}
    by_layer: dict[str, dict[str, float]] = {}  # router -> the table's layer (counted from 1) -> experts per token
    for row in layers:
        value = cell_value(row.get("active experts", ""))
        if value is not None:
            by_layer.setdefault(row["Router"], {})[row["Layer"]] = value
    uneven = {r: v for r, v in by_layer.items() if max(v.values()) - min(v.values()) > 0.5}
    compute = _expert_flops(directory / "efficiency.csv")
    cpu = s.get("run_cpu_seconds", {})
    findings = [
        first,
        "Held-out loss, one seed (no test; [`results/mini-seeds`](../mini-seeds/README.md) tests over seeds): "
        + ", ".join(f"{r} {num(heldout[r], '.3f')}{_compute_note(compute, r)}" for r in order) + ".",
        "Load imbalance (max / mean tokens per expert, mean over layers; 1 is even, "
        f"{num(max(v for v in imbalance.values() if v is not None))} the largest here): "
        + ", ".join(f"{r} {num(v)}" for r, v in sorted(imbalance.items(), key=lambda kv: -(kv[1] or 0))) + ".",
        "Specialisation score (0: every domain routed alike): "
        + ", ".join(f"{r} {num(v)}" for r, v in sorted(spec.items(), key=lambda kv: -kv[1])) + ".",
    ]
    if uneven:
        findings.append(
            "Experts per token differ between layers for "
            + "; ".join(f"{r} ({' / '.join(map(num, vals.values()))} in layers {', '.join(vals)})" for r, vals in uneven.items())
            + "."
        )
    if cpu:
        findings.append(_cpu(cpu))
    wall = _wall(s, len(final) * s["seeds"])
    if wall:
        findings.append(wall)
    tables = [directory / f"{t}.md" for t in ("zero_shot", "validation", "efficiency", "routing")]
    readme = page(
        f"The router comparison on the embedded default, {s['steps']} steps, {s['seeds']} seed",
        s["command"], findings, [t for t in tables if t.is_file()], plots(directory),
    )
    dirmoe, ref = imbalance.get("dirmoe"), imbalance.get(REFERENCE_ROUTER)
    block = [
        f"- {first}",
        f"- One seed, untested: load imbalance dirmoe {num(dirmoe)}, dirmoe+centered "
        f"{num(imbalance.get('dirmoe+centered'))}, {REFERENCE_ROUTER} {num(ref)}; specialisation score dirmoe "
        f"{num(spec.get('dirmoe'))}, {REFERENCE_ROUTER} {num(spec.get(REFERENCE_ROUTER))}.",
        *([f"- {_cpu(cpu)}"] if cpu else []),
        f"- {link(directory.name)}",
    ]
    return Writeup(directory.name, readme, "\n".join(block))


# ------------------------------------------------------------------------------------------ mini, over seeds
def _loss_family(per_seed: dict[str, dict[str, list]], key: str) -> dict[str, Any]:
    def by_seed(router: str) -> dict[str, float]:
        return dict(zip(map(str, per_seed[router]["seed"]), per_seed[router][key]))

    others = {r: by_seed(r) for r in per_seed if r != REFERENCE_ROUTER}
    return paired_tests({router: (by_seed(REFERENCE_ROUTER), values) for router, values in others.items()})


def _loss_sentence(label: str, family: dict[str, Paired], compute: dict[str, float]) -> str:
    significant = [r for r, p in family.items() if p.p_holm is not None and p.p_holm < ALPHA]
    smallest = min((r for r in family if family[r].p is not None), key=lambda r: family[r].p, default=None)
    n = max((p.n for p in family.values()), default=0)
    text = f"{label}, paired by seed against {REFERENCE_ROUTER}, Holm over the {len(family)} routers: "
    if significant:
        text += f"significantly different after Holm: {listing(significant)}."
    else:
        text += f"none significant after Holm ({family_power(n, len(family))})."
    if smallest is not None:
        text += f" Smallest raw p: {compared(smallest + _compute_note(compute, smallest), family[smallest], REFERENCE_ROUTER, '.3f')}."
    if compute:
        text += (" Unequal compute (expert FLOPs per token against " + REFERENCE_ROUTER + "'s, the efficiency "
                 "table of the first seed): " + ", ".join(f"{r} {100 * v:+.1f}%" for r, v in compute.items()) + ".")
    return text


def _caption_tests(table: Path) -> int:
    """The size of a seeded table's Holm family, from its caption (``Holm-adjusted over all N tests``; 0 when the
    table is missing or its family is per column)."""
    try:
        match = re.search(r"Holm-adjusted over all (\d+) tests", table.read_text())
    except OSError:
        return 0
    return int(match.group(1)) if match else 0


def _first_seed_source(directory: Path, per_seed: dict[str, dict[str, list]]) -> str:
    """Which runs the first seed is: those of ``results/mini`` when every router's held-out loss there is this
    study's first seed's to the last digit (same settings, deterministic CPU training), else its own."""
    mini_summary = directory.parent / "mini" / "summary.json"
    theirs = load_json(mini_summary).get("heldout_loss", {}) if mini_summary.is_file() else {}
    first = {r: v["heldout_loss"][0] for r, v in per_seed.items()}
    if theirs and all(theirs.get(r) == v for r, v in first.items()):
        return ("The first seed's runs are those of [`results/mini`](../mini/README.md) (same settings and seed; "
                "every router's held-out loss agrees to the last digit), whose per-run tables are theirs.")
    differ = ", ".join(f"{r} {num(v, '.4f')} against {num(theirs[r], '.4f')}" for r, v in first.items() if r in theirs)
    return ("The first seed's runs are this study's own, trained with the same settings and seeds as "
            "[`results/mini`](../mini/README.md)'s but not equal to them (held-out loss here against there: "
            f"{differ or 'no runs in common'}); this directory's per-run tables are its first seed's.")


#: Seed counts at which the mini comparison's power is stated, and the one ``nox -s mini-power`` runs.
POWER_SEEDS = (3, 6, 10)


def _seeds_needed(per_seed: dict[str, dict[str, list]], cpu: dict[str, float]) -> str:
    """How many seeds the held-out comparison needs: the pooled standard deviation of the routers' paired held-out
    differences against the reference router, what Holm's first step over the routers detects with 80% power at
    :data:`POWER_SEEDS` seeds, beside the differences the seeds show, and the cost of the largest count."""
    ref = per_seed[REFERENCE_ROUTER]["heldout_loss"]
    diffs = {r: [a - b for a, b in zip(v["heldout_loss"], ref)] for r, v in per_seed.items() if r != REFERENCE_ROUTER}
    spread = [statistics.variance(d) for d in diffs.values() if len(d) > 1]
    if not spread:
        return ""
    sd = statistics.fmean(spread) ** 0.5
    tests = len(diffs)
    reach = ", ".join(f"±{num(paired_detectable_effect(n, tests) * sd, '.3f')} at {n}" for n in POWER_SEEDS)
    means = sorted(abs(statistics.fmean(d)) for d in diffs.values())
    text = (f"Seeds needed: the routers' paired held-out differences against {REFERENCE_ROUTER} spread by a pooled "
            f"standard deviation of {num(sd, '.3f')} nats over these seeds; with Holm over the {tests} routers, 80% "
            f"power at Holm's first step reaches {reach} seeds, against observed differences of "
            f"{num(means[0], '.3f')} to {num(means[-1], '.3f')} nats.")
    if cpu:
        runs = (tests + 1) * POWER_SEEDS[-1]
        text += (f" `nox -s mini-power` trains {POWER_SEEDS[-1]} seeds ({runs} runs): about "
                 f"{num(statistics.median(cpu.values()) * runs / 3600, '.1f')} CPU-hours at this study's median "
                 "CPU-seconds per run, before evaluation.")
    return text


def mini_seeds(directory: Path) -> Writeup:
    """``results/mini-seeds``: the comparison over seeds, each router tested against Switch."""
    s = load_json(directory / "summary.json")
    per_seed = s["per_seed"]
    seeds = per_seed[REFERENCE_ROUTER]["seed"]
    heldout = _loss_family(per_seed, "heldout_loss")
    valid = _loss_family(per_seed, "validation_loss")
    spread = {
        key: statistics.median(statistics.stdev(v[key]) for v in per_seed.values() if len(v[key]) > 1)
        for key in ("validation_loss", "heldout_loss")
    }
    zero_shot = read_rows(directory / "zero_shot_seeds.csv")
    marked_zs = [f"{r['Router']} ({c})" for r in zero_shot for c, v in r.items() if c not in ("Router", "seeds") and cell_marked(v)]
    routing = _mean_rows(directory, "routing_seeds.csv")
    # The first seed's efficiency table: this directory's, else results/mini's (the same runs when they match).
    compute = _expert_flops(next((t for t in (directory / "efficiency.csv", directory.parent / "mini" / "efficiency.csv")
                                  if t.is_file()), directory / "efficiency.csv"))
    marks = {r: [c for c, v in row.items() if c not in ("Router", "seeds") and cell_marked(v)] for r, row in routing.items()}
    routing_tests = _caption_tests(directory / "routing_seeds.md") or len(routing) - 1  # else: a column's routers

    def imbalance(router: str) -> str:
        cell = routing[router]["load imbalance"]
        word = ("differs significantly (the table's mark)" if cell_marked(cell) else
                f"not marked ({family_power(len(seeds), routing_tests)})")
        return f"{router} {num(cell_value(cell))} ± {num(cell_half_width(cell))}: {word}"

    routing_text = (
        f"Load imbalance against {REFERENCE_ROUTER}'s {num(cell_value(routing[REFERENCE_ROUTER]['load imbalance']))}: "
        + "; ".join(imbalance(r) for r in ("dirmoe", "dirmoe+centered") if r in routing) + "."
    )
    findings = [
        _loss_sentence("Held-out loss (the same held-out tokens for every run)", heldout, compute),
        _loss_sentence("Validation loss (`valid split`, drawn anew by each seed's data order)", valid, compute),
        f"Spread over seeds (median over routers of the standard deviation): valid split {num(spread['validation_loss'], '.3f')}, "
        f"held-out {num(spread['heldout_loss'], '.3f')} nats.",
        "Zero-shot cells marked as differing from the reference: " + listing(marked_zs) + ".",
        routing_text,
        "Routing statistics marked: " + "; ".join(f"{r}: {', '.join(m)}" for r, m in marks.items() if m) + ".",
        *([_cpu(s["run_cpu_seconds"])] if s.get("run_cpu_seconds") else []),
        *filter(None, [_seeds_needed(per_seed, s.get("run_cpu_seconds", {}))]),
    ]
    tables = [directory / f"{t}.md" for t in ("zero_shot_seeds", "validation_seeds", "routing_seeds")]
    readme = page(
        f"The router comparison over {len(seeds)} seeds ({', '.join(map(str, seeds))})",
        s["command"], findings, [t for t in tables if t.is_file()],
        [_first_seed_source(directory, per_seed)],
    )
    block = [f"- {f}" for f in (*findings[:5], link(directory.name))]
    return Writeup(directory.name, readme, "\n".join(block))


# ------------------------------------------------------------------------------------------ benchmarks
#: routers.json is the nox session's; the other files name their benchmark modules and timers above their tables.
BENCH_COMMAND = (
    "nox -s bench` (routers.json); the others: `pytest MODULE --benchmark-only --benchmark-enable "
    "--benchmark-timer=time.TIMER --benchmark-json=results/bench/FILE"
)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return num(ms, ".0f" if ms >= 100 else ".1f" if ms >= 10 else ".2f")


def _per_round(extra: dict[str, Any], label: str, brackets: bool = False) -> str:
    """The mean of ``label``'s per-round ratios to Switch with its 95% interval (the interleaved benchmark's
    ``over_switch_per_round``), as a clause; "" in runs that did not record them."""
    ci = (extra.get("over_switch_per_round") or {}).get(label)
    if not ci or ci.get("low") is None:
        return ""
    text = f"per round {num(ci['estimate'], '.3f')}, 95% CI {num(ci['low'], '.3f')} to {num(ci['high'], '.3f')}"
    return f" ({text})" if brackets else f"; {text}"


def _bench_file(path: Path) -> tuple[list[str], list[str], list[str]]:
    """One pytest-benchmark JSON: its findings (medians per group; DirMoE over Switch stepped alternately),
    the subset for the README block, and its table."""
    from repro.report.bench_table import render_bench, summarise

    data = load_json(path)
    rows = summarise(data, origin=str(path))
    timers = sorted({str((b.get("options") or {}).get("timer", "?")) for b in data["benchmarks"]})
    modules = sorted({str(b.get("fullname", "?")).split("::")[0] for b in data["benchmarks"]})
    findings = []
    for group in dict.fromkeys(r.group for r in rows):
        members = [
            f"{r.router} {_ms(r.median_s)} ms"
            + ("" if r.ratio_to_baseline is None or r.router == REFERENCE_ROUTER else f" ({num(r.ratio_to_baseline)} x {REFERENCE_ROUTER})")
            for r in rows if r.group == group
        ]
        findings.append(f"`{path.name}`, {group}, median: {', '.join(members)}.")
    alternating = [
        f"`{path.name}`: DirMoE / Switch median training iteration, stepped in turn "
        f"({b['stats']['rounds']} rounds): {num(extra['dirmoe_over_switch'], '.3f')} "
        f"({_ms(extra['dirmoe_median_s'])} against {_ms(extra['switch_median_s'])} ms{_per_round(extra, 'dirmoe')})"
        + "".join(f"; {label} {num(ratio, '.3f')}{_per_round(extra, label, brackets=True)}"
                  for label, ratio in (extra.get("over_switch") or {}).items() if label != "dirmoe")
        + "."
        for b in data["benchmarks"] if "dirmoe_over_switch" in (extra := b.get("extra_info") or {})
    ]
    key = (findings[:1] if path.name == "routers.json" else []) + alternating
    table = [f"### `{path.name}`: {', '.join(modules)}, timer {', '.join(timers)}", "", render_bench(rows).rstrip(), ""]
    return findings + alternating, key, table


def _costs_file(path: Path) -> tuple[list[str], list[str], list[str]]:
    """``router_costs.json`` (``python -m repro study router-costs --out results/bench``): launches and host syncs per router call,
    forward + backward on a non-logging step; counts, so exact, with no test."""
    rows = [r for r in load_json(path)["rows"] if r["pass"] == "fwd+bwd"]
    launches = ", ".join(f"{r['router']} {r['launches']} ({num(r['x_switch'])} x {REFERENCE_ROUTER})" for r in rows)
    syncs = sum(r["syncs"] for r in rows)
    compiled = [r["router"] for r in rows if r.get("regions")]
    # A region's kernels are those of the backend that compiled it (C++ here), which fuses more than a GPU's.
    caveat = (f"; {', '.join(compiled)} with its compiled regions' kernels as inductor's CPU backend generates "
              "them, fewer than a GPU launches (docs/efficiency.md)") if compiled else ""
    finding = (
        f"`{path.name}` (`python -m repro study router-costs --out results/bench`), launches per router call, forward + backward on a "
        f"non-logging step: {launches}{caveat}; host synchronisations in all of them together: {syncs}."
    )
    table = [f"### `{path.name}`", "", f"See [`{path.stem}.md`]({path.stem}.md).", ""]
    return [finding], [finding], table


def bench(directory: Path) -> Writeup:
    """``results/bench``: every pytest-benchmark JSON there (medians of one run each: no test, no comparison word),
    and the router cost counts."""
    findings, key, tables = [], [], ["## Tables", ""]
    for path in sorted(directory.glob("*.json"), key=lambda p: (p.name != "routers.json", p.name)):
        f, k, table = (_costs_file if path.name == "router_costs.json" else _bench_file)(path)
        findings, key, tables = findings + f, key + k, tables + table
    readme = page("Micro-benchmarks (pytest-benchmark; medians of one run each, no test)", BENCH_COMMAND, findings, [], tables)
    return Writeup(directory.name, readme, "\n".join(f"- {line}" for line in (*key, link(directory.name))))


# ------------------------------------------------------------------------------------------ DirMoE ablation
LAYERS = ("load_imbalance[0]", "load_imbalance[1]")
#: How the summary's Holm family (``summary.json`` ``family``) reads in a sentence.
_FAMILY_WORDS = {"column": "the cells of its column", "table": "every test of its table (all cells and columns)"}

#: The cell whose rows of the cell-against-cell table the write-up quotes (the README's claims are about it).
FOCUS = "recon-centered"
#: The cell-against-cell table's file stem (``ablation_tables.pairs_table``).
PAIRS_TABLE = "ablation_pairs"
#: The confirmatory study's table of its pre-registered hypotheses (``ablation_tables.confirm_table``).
CONFIRM_TABLE = "ablation_confirm"


def read_paired(entry: dict[str, Any], versus: str, reference_values: dict[str, float]) -> Paired | None:
    """The comparison with ``versus`` that the summary holds in one cell's entry for one metric (its
    ``vs_<versus>``, written by ``ablation_tables.results_to_json``), None where there is no test;
    ``reference_values``: the per-seed values of ``versus`` (to count the seeds where this cell is lower)."""
    test = entry.get(f"vs_{versus}")
    if not test:
        return None
    diff = test.get("difference") or {}
    low, high = diff.get("ci95") or (None, None)
    values = entry["values"]
    shared = [s for s in values if s in reference_values]
    lower = sum(values[s] < reference_values[s] for s in shared)
    return Paired(diff.get("mean", 0.0), low, high, test.get("p"), test.get("p_holm"), len(shared), lower)


def _values(results: dict[str, Any], cell: str, metric: str) -> dict[str, float]:
    return results[cell][metric]["values"]


def _per_seed(values: dict[str, float], spec: str = ".2f") -> str:
    return " / ".join(num(values[s], spec) for s in sorted(values, key=int))


def _family(results: dict[str, Any], versus: str) -> dict[tuple[str, str], Paired]:
    """Every test against ``versus`` the summary holds, ``(cell, metric) -> Paired``: one Holm family (the
    table's, as ``ablation_tables`` adjusts it), each with the family's size and the exact sign-flip test."""
    found: dict[tuple[str, str], Paired] = {}
    pairs = {}
    for cell, metrics in results.items():
        for metric, entry in metrics.items():
            if isinstance(entry, dict) and (entry.get(f"vs_{versus}") or {}).get("p") is not None:
                reference = _values(results, versus, metric)
                p = read_paired(entry, versus, reference)
                if p is not None:
                    found[(cell, metric)], pairs[(cell, metric)] = p, (reference, entry["values"])
    return with_sign_flip({k: replace(p, family=len(found)) for k, p in found.items()}, pairs)


def _versus(results: dict[str, Any], cell: str, metric: str, ref: str) -> Paired | None:
    tested = _family(results, ref).get((cell, metric))
    return tested if tested is not None else read_paired(results[cell][metric], ref, _values(results, ref, metric))


def _reference_findings(results: dict[str, Any]) -> list[str]:
    """The paper's DirMoE against Switch: per-seed imbalance, the differences and the validation loss."""
    out = []
    for layer, metric in enumerate(LAYERS, start=1):
        text = f"Load imbalance of `{REFERENCE}` per seed, layer {layer}: {_per_seed(_values(results, REFERENCE, metric))}"
        if SWITCH in results:
            sw = _values(results, SWITCH, metric)
            text += f"; {SWITCH}: {num(min(sw.values()))} to {num(max(sw.values()))}"
            p = _versus(results, REFERENCE, metric, SWITCH)
            if p is not None:
                text += f"; {compared(REFERENCE, p, SWITCH)}"
        out.append(text + ".")
    p = _versus(results, REFERENCE, "val_loss", SWITCH) if SWITCH in results else None
    if p is not None:
        out.append(
            f"Validation loss: {REFERENCE} {num(results[REFERENCE]['val_loss']['mean'], '.3f')}, {SWITCH} "
            f"{num(results[SWITCH]['val_loss']['mean'], '.3f')}; {compared(REFERENCE, p, SWITCH, '.3f')}; "
            f"{SWITCH} lower in {p.n - p.n_lower} of {p.n} seeds."
        )
    return out


def _cell_finding(results: dict[str, Any], cells: dict[str, Any], cell: str) -> str:
    """One cell against the paper's DirMoE: load (or, where the load is flat by construction, weight) imbalance
    per layer and the validation loss."""
    flat = all(v == 1.0 for m in LAYERS for v in _values(results, cell, m).values())
    metrics = [m.replace("load_", "weight_") for m in LAYERS] if flat else list(LAYERS)
    what = "weight imbalance (every expert gets every token)" if flat else "load imbalance"
    parts = []
    for layer, metric in enumerate(metrics, start=1):
        p = _versus(results, cell, metric, REFERENCE)
        if p is not None:
            parts.append(f"layer {layer} {num(results[cell][metric]['mean'])} (difference {num(p.mean)}): {verdict(p)}")
    p = _versus(results, cell, "val_loss", REFERENCE)
    loss = "" if p is None else f"; validation loss (difference {num(p.mean, '.3f')}): {verdict(p)}"
    reading = cells.get(cell, {}).get("reading", "")
    return f"`{cell}` ({reading}), {what}: {'; '.join(parts)}{loss}."


def _theta_finding(results: dict[str, Any], window: int | None) -> str | None:
    metric = "simpson_theta"
    ref = results[REFERENCE].get(metric, {}).get("mean")
    if ref is None:
        return None
    moved = []
    for cell in results:
        p = _versus(results, cell, metric, REFERENCE) if cell != REFERENCE else None
        if p is not None and p.p_holm is not None and p.p_holm < ALPHA:
            moved.append(f"{cell} {num(results[cell][metric]['mean'])}: {verdict(p)}")
    return (
        f"Simpson index of the Dirichlet draws theta (mean over the last {window} steps): {REFERENCE} {num(ref)}; cells that differ "
        f"after Holm: {'; '.join(moved) or 'none'}."
    )


def _contrast_findings(directory: Path, summary: dict[str, Any]) -> list[str]:
    """The rows of the cell-against-cell table with :data:`FOCUS`, per layer, with that table's tests (its pairs,
    columns and family; empty where the study has no such table)."""
    path = directory / f"{PAIRS_TABLE}.csv"
    if not path.is_file():
        return []
    pairs = [tuple(row["Cells"].split(" - ")) for row in read_rows(path)]
    results = results_from_json(summary)
    keys = [m.key for m in difference_metrics(results)]
    stats = compare_cell_pairs(results, pairs, keys, family=summary.get("family", "table"))
    defined = sum(s.defined for s in stats.values())
    quoted = [(a, b) for a, b in pairs if FOCUS in (a, b)]
    cells = list(dict.fromkeys(c for pair in quoted for c in pair))
    values = summary["results"]
    out = []
    for layer, metric in enumerate(LAYERS, start=1):
        diffs = ", ".join(f"{c} {num(values[c][metric]['vs_' + REFERENCE]['difference']['mean'])}" for c in cells)
        tests = "; ".join(
            compared(a, p, b) for a, b in quoted
            if (p := paired(stats[(a, b, metric)], _values(values, a, metric), _values(values, b, metric)))
        )
        out.append(
            f"Layer {layer}, each cell minus `{REFERENCE}`: {diffs}. Cell against cell (`{PAIRS_TABLE}`, "
            f"Holm over its {defined} tests): {tests}."
        )
    return out


def _cost(summary: dict[str, Any]) -> list[str]:
    cost = summary.get("cost", {})
    if not cost.get("cpu_seconds_measured_runs"):
        return []
    return [f"Cost: {num(cost['cpu_seconds_measured_runs'], '.0f')} CPU-seconds for the {cost.get('runs_measured')} "
            f"of {cost.get('runs')} runs whose workers were timed."]


def _command(summary: dict[str, Any], directory: Path) -> str:
    """The command that wrote an ablation's directory (the summary's ``command`` names the entry point alone; the
    selection it ran is in the summary too)."""
    return (
        f"python -m repro study ablation{' --confirm' if summary.get('confirm') else ''} --cells "
        f"{','.join(summary['results'])} --seeds {','.join(map(str, summary.get('seeds', [])))} "
        f"--steps {summary.get('steps')} --out results/{directory.name}"
        + "".join(f" --set {o}" for o in summary.get("overrides", []))
    )


def screen(directory: Path) -> Writeup:
    """``results/dirmoe-ablation``, the screen over every cell: its README block names the cells whose load
    imbalance is below the paper's (the confirmatory study's block has the rest)."""
    return ablation(directory, brief=True)


def ablation(directory: Path, brief: bool = False) -> Writeup:
    """``results/dirmoe-ablation*``: every cell against the paper's DirMoE, and the cell-vs-cell family.

    Args:
        directory: the study's results directory.
        brief: a README block of the lowered cells alone.
    """
    s = load_json(directory / "summary.json")
    results, cells = s["results"], s.get("cells", {})
    seeds = s.get("seeds", [])
    others = [c for c in results if c != REFERENCE]
    contrasts = _contrast_findings(directory, s)
    findings = [
        "Each test: a paired t-test over the seeds two cells share, Holm-adjusted over "
        f"{_FAMILY_WORDS.get(s.get('family', 'column'), 'its family')} (the tables' marks); a raw p below {ALPHA:g} "
        "that Holm's adjustment does not keep is reported as such.",
        *_reference_findings(results),
        *(_cell_finding(results, cells, c) for c in others if c != SWITCH and REFERENCE in results),
        *filter(None, [_theta_finding(results, s.get("final_window_steps"))]),
        *contrasts,
    ]
    findings += _cost(s)
    tables = [directory / f"{t}.md" for t in ("ablation", "ablation_differences", "ablation_vs_switch", PAIRS_TABLE)]
    readme = page(
        f"The DirMoE ablation: {len(results)} cells x {len(seeds)} seeds, {s.get('steps')} steps",
        _command(s, directory), findings, [t for t in tables if t.is_file()], plots(directory),
    )
    return Writeup(directory.name, readme, "\n".join(_block(results, directory.name, brief, contrasts)))


def confirm(directory: Path) -> Writeup:
    """``results/dirmoe-ablation-confirm``: the hypotheses its summary records, stated before its seeds were run,
    tested on those seeds alone (one Holm family: the hypotheses)."""
    s = load_json(directory / "summary.json")
    results, seeds = s["results"], s.get("seeds", [])
    hypotheses = [h for h in s.get("hypotheses", []) if h["cell"] in results and h["versus"] in results]
    family = paired_tests({
        i: (_values(results, h["versus"], h["key"]), _values(results, h["cell"], h["key"])) for i, h in enumerate(hypotheses)
    })
    findings = [
        f"Hypotheses stated from the screens (seeds 1-6) before these seeds ({', '.join(map(str, seeds))}) were run, "
        f"tested on them alone: paired t-tests over the seeds, Holm-adjusted over the {len(family)} hypotheses; "
        "a hypothesis that predicts a direction and is significant the other way is refuted; each also has the "
        "exact sign-flip test over the same seeds and family, named where it does not confirm the t-test."
    ]
    for i, h in enumerate(hypotheses):
        if i in family:
            p = family[i]
            findings.append(
                f"Hypothesis \"{h['claim']}\" ({h['key']}, {h['cell']} minus {h['versus']}): {num(p.mean, '.3f')} "
                f"[{num(p.low, '.3f')}, {num(p.high, '.3f')}], {verdict(p, spec='.3f', expect=h.get('expect'))}."
            )
    findings.append(
        f"This study's inference is the table `{CONFIRM_TABLE}` alone: one family per comparison, so a confirmatory "
        "study writes none of the screen's tables, which would test the same cells again in other families."
    )
    findings += _cost(s)
    table = directory / f"{CONFIRM_TABLE}.md"
    readme = page(f"DirMoE ablation, confirmatory: {len(results)} cells x {len(seeds)} new seeds",
                  _command(s, directory), findings, [table] if table.is_file() else [], plots(directory))
    return Writeup(directory.name, readme, "\n".join([*(f"- {f}" for f in findings[1:len(hypotheses) + 1]),
                                                      f"- {link(directory.name)}"]))


def _block(results: dict[str, Any], study: str, brief: bool, contrasts: list[str]) -> list[str]:
    """The README block: the reference's collapse, which cells lower it (both layers), the cell-vs-cell tests."""
    lowered = {
        layer: [c for c in results if c not in (REFERENCE,) and (p := _versus(results, c, m, REFERENCE)) is not None
                and p.p_holm is not None and p.p_holm < ALPHA and p.mean < 0]
        for layer, m in enumerate(LAYERS, start=1)
    }
    neither = [c for c in results if c != REFERENCE and c not in lowered[1] and c not in lowered[2]]
    seeds = len(results[REFERENCE]["seeds"])
    tests = len(_family(results, REFERENCE))
    if paired_detectable_effect(seeds, max(1, tests)) > UNDERPOWERED_EFFECT:
        rest = f"the others are not evidence of no effect ({family_power(seeds, tests)})"
    else:
        rest = f"in neither layer: {listing(neither)} ({family_power(seeds, tests)})"
    lowered_text = (
        f"- {seeds} seeds: load imbalance significantly below `{REFERENCE}`'s after Holm: layer 1 "
        f"{listing(lowered[1])}; layer 2 {listing(lowered[2])}; {rest}."
    )
    if brief:
        return [lowered_text, f"- {link(study)}"]
    block = [f"- {f}" for f in _reference_findings(results)]
    block.append(lowered_text)
    block += [f"- {f}" for f in contrasts]
    block.append(f"- {link(study)}")
    return block
