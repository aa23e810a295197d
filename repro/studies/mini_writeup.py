"""The mini comparison's write-ups (``python -m repro report writeup``): ``results/mini`` and the comparison over
seeds (``results/mini-seeds``, ``mini-power``), each from its ``summary.json`` alone (the study writes there the tests
behind its tables' marks: :func:`repro.studies.mini.tested`). Comparison words come from
:func:`repro.report.verdicts.verdict` or a table's own mark.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from repro.report.verdicts import (
    ALPHA,
    Paired,
    Writeup,
    compared,
    family_power,
    link,
    listing,
    load_json,
    num,
    page,
    paired_tests,
    plots,
)
from repro.stats import paired_detectable_effect

REFERENCE_ROUTER = "switch"


def _cpu(cpu: dict[str, float]) -> str:
    return (
        f"Each run took {num(min(cpu.values()), '.0f')} to {num(max(cpu.values()), '.0f')} CPU-seconds "
        f"({num(sum(cpu.values()), '.0f')} for the {len(cpu)} runs; `run_cpu_seconds`)."
    )


def _wall(summary: dict[str, Any], runs: int) -> str:
    """The wall time of the invocation that wrote the summary ('' where it does not say)."""
    wall, trained = summary.get("wall_seconds"), summary.get("trained_runs")
    if wall is None or trained is None:
        return ""
    reused = f", reusing the other {runs - len(trained)}" if len(trained) < runs else ""
    return (f"The invocation that wrote these files took {num(wall / 60, '.1f')} min of wall time and trained "
            f"{len(trained)} of the {runs} runs{reused} (`wall_seconds`, `trained_runs`).")


def _compute_note(compute: dict[str, float], router: str) -> str:
    """`` (+x% expert FLOPs)`` beside a router of unequal compute, '' otherwise."""
    return f" ({100 * compute[router]:+.1f}% expert FLOPs)" if router in compute else ""


def mini(directory: Path) -> Writeup:
    """``results/mini``: one seed of every router (no tests possible; the seeds study has them)."""
    s = load_json(directory / "summary.json")
    final, unigram = s["final_train_lm_loss_last10"], s["unigram_loss"]
    heldout, spec = s["heldout_loss"], s.get("specialisation_score", {})
    routing = s["routing"]
    above = [r for r, v in final.items() if v >= unigram]
    runs_text = ", ".join(f"{r} {num(v)}" for r, v in final.items())
    first = (
        f"Every run's final training LM loss (mean of the last 10 steps) is below the unigram baseline "
        f"({num(unigram)} nats/token): {runs_text}."
        if not above else f"Runs at or above the unigram baseline ({num(unigram)}): {listing(above)}. All: {runs_text}."
    )
    order = sorted(heldout, key=heldout.get)
    imbalance = {r: v["load_imbalance"] for r, v in routing.items()}
    by_layer = {r: {k: x for k, x in v["active_experts"].items() if x is not None} for r, v in routing.items()}
    uneven = {r: v for r, v in by_layer.items() if v and max(v.values()) - min(v.values()) > 0.5}
    compute = s.get("expert_flops_off_parity", {})
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
    findings += [line for line in (_cpu(cpu) if cpu else "", _wall(s, len(final) * s["seeds"])) if line]
    tables = [directory / f"{t}.md" for t in ("zero_shot", "validation", "efficiency", "routing")]
    readme = page(
        f"The router comparison on the embedded default, {s['steps']} steps, {s['seeds']} seed",
        s["command"], findings, [t for t in tables if t.is_file()], plots(directory),
    )
    block = [
        f"- {first}",
        f"- One seed, untested: load imbalance dirmoe {num(imbalance.get('dirmoe'))}, dirmoe+centered "
        f"{num(imbalance.get('dirmoe+centered'))}, {REFERENCE_ROUTER} {num(imbalance.get(REFERENCE_ROUTER))}; "
        f"specialisation score dirmoe {num(spec.get('dirmoe'))}, {REFERENCE_ROUTER} {num(spec.get(REFERENCE_ROUTER))}.",
        *([f"- {_cpu(cpu)}"] if cpu else []),
        f"- {link(directory.name)}",
    ]
    return Writeup(directory.name, readme, "\n".join(block))


# ------------------------------------------------------------------------------------------ over seeds
def _loss_family(per_seed: dict[str, dict[str, list]], key: str) -> dict[str, Any]:
    def by_seed(router: str) -> dict[str, float]:
        return dict(zip(map(str, per_seed[router]["seed"]), per_seed[router][key]))

    return paired_tests({r: (by_seed(REFERENCE_ROUTER), by_seed(r)) for r in per_seed if r != REFERENCE_ROUTER})


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
                 "table of the first seed): " + ", ".join(f"{r} {100 * v:+.1f}%" for r, v in sorted(compute.items())) + ".")
    return text


def _first_seed_source(directory: Path, per_seed: dict[str, dict[str, list]]) -> str:
    """Which runs the first seed is: ``results/mini``'s when every held-out loss matches to the last digit
    (deterministic CPU training), else its own."""
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
    """Seeds the held-out comparison needs: pooled SD of paired held-out differences to the reference, what
    Holm's first step detects with 80% power at :data:`POWER_SEEDS` seeds vs the observed differences, and the cost."""
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
    over_seeds, compute = s["over_seeds"], s.get("expert_flops_off_parity", {})
    marked_zs = [f"{r} ({c})" for r, cells in over_seeds["zero_shot"]["cells"].items() for c, v in cells.items()
                 if v["marked"]]
    routing = over_seeds["routing"]["cells"]
    marks = {r: [c for c, v in cells.items() if v["marked"]] for r, cells in routing.items()}
    # The Holm family of the load-imbalance marks: the whole table's tests, or (per column) the column's routers.
    routing_tests = over_seeds["routing"]["tests"] if over_seeds["routing"]["family"] == "table" else len(routing) - 1

    def imbalance(router: str) -> str:
        cell = routing[router]["load imbalance"]
        word = ("differs significantly (the table's mark)" if cell["marked"] else
                f"not marked ({family_power(len(seeds), routing_tests)})")
        return f"{router} {num(cell['mean'])} ± {num(cell['half_width'])}: {word}"

    routing_text = (
        f"Load imbalance against {REFERENCE_ROUTER}'s {num(routing[REFERENCE_ROUTER]['load imbalance']['mean'])}: "
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
