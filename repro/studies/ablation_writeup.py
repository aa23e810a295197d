"""The DirMoE ablation's write-ups (``python -m repro report writeup``), from each study's ``summary.json``: it
holds every cell's per-seed values and its paired comparisons with the paper's DirMoE and with Switch (the tests
behind the tables' marks), which are read, not recomputed. A cell against another is quoted only from the
cell-against-cell table, ``ablation_pairs``, in that table's family (docs/evaluation.md: one family per comparison).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from repro.report.ablation_tables import REFERENCE, SWITCH, compare_cell_pairs, difference_metrics, results_from_json
from repro.report.verdicts import (
    ALPHA,
    UNDERPOWERED_EFFECT,
    Paired,
    Writeup,
    compared,
    family_power,
    link,
    listing,
    load_json,
    num,
    page,
    paired,
    paired_tests,
    plots,
    verdict,
    with_sign_flip,
)
from repro.stats import paired_detectable_effect

LAYERS = ("load_imbalance[0]", "load_imbalance[1]")
#: How the summary's Holm family (``summary.json`` ``family``) reads in a sentence.
_FAMILY_WORDS = {"column": "the cells of its column", "table": "every test of its table (all cells and columns)"}

#: The cell whose cell-against-cell rows the write-up quotes (the README's claims are about it).
FOCUS = "recon-centered"
#: The cell-against-cell table's file stem (``ablation_tables.pairs_table``).
PAIRS_TABLE = "ablation_pairs"
#: The confirmatory study's table of its pre-registered hypotheses (``ablation_tables.confirm_table``).
CONFIRM_TABLE = "ablation_confirm"


def read_paired(entry: dict[str, Any], versus: str, reference_values: dict[str, float]) -> Paired | None:
    """The summary's ``vs_<versus>`` comparison in one cell's metric entry (None: no test);
    ``reference_values``: ``versus``'s per-seed values (to count seeds where this cell is lower)."""
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


def _family(results: dict[str, Any], versus: str) -> dict[tuple[str, str], Paired]:
    """Every summary test against ``versus``, ``(cell, metric) -> Paired``: one Holm family (the table's), each
    with the family's size and the exact sign-flip test."""
    found: dict[tuple[str, str], Paired] = {}
    pairs: dict[tuple[str, str], tuple[dict[str, float], dict[str, float]]] = {}
    for cell, metrics in results.items():
        for metric, entry in metrics.items():
            if isinstance(entry, dict) and (entry.get(f"vs_{versus}") or {}).get("p") is not None:
                reference = _values(results, versus, metric)
                found[(cell, metric)] = read_paired(entry, versus, reference)  # (a test: never None)
                pairs[(cell, metric)] = reference, entry["values"]
    return with_sign_flip({k: replace(p, family=len(found)) for k, p in found.items()}, pairs)


def _versus(results: dict[str, Any], cell: str, metric: str, ref: str) -> Paired | None:
    tested = _family(results, ref).get((cell, metric))
    return tested if tested is not None else read_paired(results[cell][metric], ref, _values(results, ref, metric))


def _reference_findings(results: dict[str, Any]) -> list[str]:
    """The paper's DirMoE against Switch: per-seed imbalance, the differences and the validation loss."""
    out = []
    for layer, metric in enumerate(LAYERS, start=1):
        ref = _values(results, REFERENCE, metric)
        per_seed = " / ".join(num(ref[s]) for s in sorted(ref, key=int))
        text = f"Load imbalance of `{REFERENCE}` per seed, layer {layer}: {per_seed}"
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
    """One cell against the paper's DirMoE: load (or weight) imbalance per layer, and validation loss."""
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
    """The cell-against-cell rows with :data:`FOCUS`, per layer, with that table's tests (empty without it)."""
    pairs = [tuple(pair) for pair in summary.get("pairs", [])]
    if not pairs:
        return []
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
    """The full command that wrote an ablation's directory (entry point plus the summary's selection)."""
    return (
        f"python -m repro study ablation{' --confirm' if summary.get('confirm') else ''} --cells "
        f"{','.join(summary['results'])} --seeds {','.join(map(str, summary.get('seeds', [])))} "
        f"--steps {summary.get('steps')} --out results/{directory.name}"
        + "".join(f" --set {o}" for o in summary.get("overrides", []))
    )


def ablation(directory: Path, brief: bool = False) -> Writeup:
    """``results/dirmoe-ablation*``: every cell against the paper's DirMoE, and the cell-vs-cell family
    (``brief``: a README block of the lowered cells alone)."""
    s = load_json(directory / "summary.json")
    results, cells = s["results"], s.get("cells", {})
    contrasts = _contrast_findings(directory, s)
    findings = [
        "Each test: a paired t-test over the seeds two cells share, Holm-adjusted over "
        f"{_FAMILY_WORDS.get(s.get('family', 'column'), 'its family')} (the tables' marks); a raw p below {ALPHA:g} "
        "that Holm's adjustment does not keep is reported as such.",
        *_reference_findings(results),
        *(_cell_finding(results, cells, c) for c in results if c not in (REFERENCE, SWITCH) and REFERENCE in results),
        *filter(None, [_theta_finding(results, s.get("final_window_steps"))]),
        *contrasts,
        *_cost(s),
    ]
    tables = [directory / f"{t}.md" for t in ("ablation", "ablation_differences", "ablation_vs_switch", PAIRS_TABLE)]
    readme = page(
        f"The DirMoE ablation: {len(results)} cells x {len(s.get('seeds', []))} seeds, {s.get('steps')} steps",
        _command(s, directory), findings, [t for t in tables if t.is_file()], plots(directory),
    )
    return Writeup(directory.name, readme, "\n".join(_block(results, directory.name, brief, contrasts)))


#: ``results/dirmoe-ablation``, the screen: its README block names the cells with lower load imbalance than the
#: paper's (the confirmatory block has the rest).
screen = partial(ablation, brief=True)


def confirm(directory: Path) -> Writeup:
    """``results/dirmoe-ablation-confirm``: pre-registered hypotheses on its own seeds (one Holm family)."""
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
    return [*(f"- {f}" for f in _reference_findings(results)), lowered_text, *(f"- {f}" for f in contrasts),
            f"- {link(study)}"]
