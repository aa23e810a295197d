"""The findings of each study, as sentences built from its results files (:mod:`repro.report.writeup`).

One function per kind of study directory: it reads the directory's files, and returns the study's page and its
README block. Numbers are formatted from the files; comparison words come from :func:`prose.verdict` (or,
for a table's marks, from the mark the table's own test set).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from repro.report.prose import (
    ALPHA,
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
    paired_family,
    plots,
    read_rows,
)

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
    by_layer: dict[str, list[float]] = {}
    for row in layers:
        value = cell_value(row.get("active experts", ""))
        if value is not None:
            by_layer.setdefault(row["Router"], []).append(value)
    uneven = {r: v for r, v in by_layer.items() if max(v) - min(v) > 0.5}
    cpu = s.get("run_cpu_seconds", {})
    findings = [
        first,
        "Held-out loss, one seed (no test; [`results/mini-seeds`](../mini-seeds/README.md) tests over seeds): "
        + ", ".join(f"{r} {num(heldout[r], '.3f')}" for r in order) + ".",
        "Load imbalance (max / mean tokens per expert, mean over layers; 1 is even, "
        f"{num(max(v for v in imbalance.values() if v is not None))} the largest here): "
        + ", ".join(f"{r} {num(v)}" for r, v in sorted(imbalance.items(), key=lambda kv: -(kv[1] or 0))) + ".",
        "Specialisation score (0: every domain routed alike): "
        + ", ".join(f"{r} {num(v)}" for r, v in sorted(spec.items(), key=lambda kv: -kv[1])) + ".",
    ]
    if uneven:
        findings.append(
            "Experts per token differ between layers for "
            + "; ".join(f"{r} ({' / '.join(num(v) for v in vals)} in layers {', '.join(map(str, range(len(vals))))})" for r, vals in uneven.items())
            + "."
        )
    if cpu:
        findings.append(_cpu(cpu))
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
    return paired_family(by_seed(REFERENCE_ROUTER), others)


def _loss_sentence(label: str, family: dict[str, Any]) -> str:
    significant = [r for r, p in family.items() if p.p_holm is not None and p.p_holm < ALPHA]
    smallest = min((r for r in family if family[r].p is not None), key=lambda r: family[r].p, default=None)
    text = (
        f"{label}, paired by seed against {REFERENCE_ROUTER}, Holm over the {len(family)} routers: "
        + (f"significantly different after Holm: {listing(significant)}." if significant else "no router differs significantly after Holm.")
    )
    if smallest is not None:
        text += f" Smallest raw p: {compared(smallest, family[smallest], REFERENCE_ROUTER, '.3f')}."
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
    marks = {r: [c for c, v in row.items() if c not in ("Router", "seeds") and cell_marked(v)] for r, row in routing.items()}

    def imbalance(router: str) -> str:
        cell = routing[router]["load imbalance"]
        word = "differs significantly (the table's mark)" if cell_marked(cell) else "no significant difference (no mark)"
        return f"{router} {num(cell_value(cell))} ± {num(cell_half_width(cell))}: {word}"

    routing_text = (
        f"Load imbalance against {REFERENCE_ROUTER}'s {num(cell_value(routing[REFERENCE_ROUTER]['load imbalance']))}: "
        + "; ".join(imbalance(r) for r in ("dirmoe", "dirmoe+centered") if r in routing) + "."
    )
    findings = [
        _loss_sentence("Held-out loss (the same held-out tokens for every run)", heldout),
        _loss_sentence("Validation loss (`valid split`, drawn anew by each seed's data order)", valid),
        f"Spread over seeds (median over routers of the standard deviation): valid split {num(spread['validation_loss'], '.3f')}, "
        f"held-out {num(spread['heldout_loss'], '.3f')} nats.",
        "Zero-shot cells marked as differing from the reference: " + listing(marked_zs) + ".",
        routing_text,
        "Routing statistics marked: " + "; ".join(f"{r}: {', '.join(m)}" for r, m in marks.items() if m) + ".",
        *([_cpu(s["run_cpu_seconds"])] if s.get("run_cpu_seconds") else []),
    ]
    tables = [directory / f"{t}.md" for t in ("zero_shot_seeds", "validation_seeds", "routing_seeds")]
    readme = page(
        f"The router comparison over {len(seeds)} seeds ({', '.join(map(str, seeds))})",
        s["command"], findings, [t for t in tables if t.is_file()],
        ["The per-run tables of the first seed are those of [`results/mini`](../mini/README.md)."],
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
        f"`{path.name}`: DirMoE / Switch median training iteration, the two stepped alternately "
        f"({b['stats']['rounds']} pairs): {num(extra['dirmoe_over_switch'], '.3f')} "
        f"({_ms(extra['dirmoe_median_s'])} against {_ms(extra['switch_median_s'])} ms)."
        for b in data["benchmarks"] if "dirmoe_over_switch" in (extra := b.get("extra_info") or {})
    ]
    key = (findings[:1] if path.name == "routers.json" else []) + alternating
    table = [f"### `{path.name}`: {', '.join(modules)}, timer {', '.join(timers)}", "", render_bench(rows).rstrip(), ""]
    return findings + alternating, key, table


def _costs_file(path: Path) -> tuple[list[str], list[str], list[str]]:
    """``router_costs.json`` (``python -m repro efficiency --profile``): launches and host syncs per router call,
    forward + backward on a non-logging step; counts, so exact, with no test."""
    rows = [r for r in load_json(path)["rows"] if r["pass"] == "fwd+bwd"]
    launches = ", ".join(f"{r['router']} {r['launches']} ({num(r['x_switch'])} x {REFERENCE_ROUTER})" for r in rows)
    syncs = sum(r["syncs"] for r in rows)
    finding = (
        f"`{path.name}` (`python -m repro efficiency --profile`), launches per router call, forward + backward on a "
        f"non-logging step: {launches}; host synchronisations in all of them together: {syncs}."
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


__all__ = ["bench", "mini", "mini_seeds"]
