"""The write-up of ``results/bench`` (``python -m repro report writeup``): every pytest-benchmark JSON there
(``nox -s bench`` and the benchmark modules; medians of one run each, so no test and no comparison word) and the
router cost counts of ``python -m repro study router-costs``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from repro.report.verdicts import Writeup, link, load_json, num, page

REFERENCE_ROUTER = "switch"

#: routers.json is the nox session's; the other files name their benchmark modules and timers above their tables.
BENCH_COMMAND = (
    "nox -s bench` (routers.json); the others: `pytest MODULE --benchmark-only --benchmark-enable "
    "--benchmark-timer=time.TIMER --benchmark-json=results/bench/FILE"
)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return num(ms, ".0f" if ms >= 100 else ".1f" if ms >= 10 else ".2f")


def _per_round(extra: dict[str, Any], label: str, brackets: bool = False) -> str:
    """``label``'s mean per-round ratio to Switch with its 95% interval, as a clause ("" if not recorded)."""
    ci = (extra.get("over_switch_per_round") or {}).get(label)
    if not ci or ci.get("low") is None:
        return ""
    text = f"per round {num(ci['estimate'], '.3f')}, 95% CI {num(ci['low'], '.3f')} to {num(ci['high'], '.3f')}"
    return f" ({text})" if brackets else f"; {text}"


def _bench_file(path: Path) -> tuple[list[str], list[str], list[str]]:
    """One pytest-benchmark JSON: its findings, the subset for the README block, and its table."""
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
    """``router_costs.json``: launches and host syncs per router call (exact counts, no test)."""
    rows = [r for r in load_json(path)["rows"] if r["pass"] == "fwd+bwd"]
    launches = ", ".join(f"{r['router']} {r['launches']} ({num(r['x_switch'])} x {REFERENCE_ROUTER})" for r in rows)
    syncs = sum(r["syncs"] for r in rows)
    compiled = [r["router"] for r in rows if r.get("regions")]
    # A region's kernels are its compiling backend's (C++ here), which fuses differently from a GPU's.
    caveat = (f"; {', '.join(compiled)} with its compiled regions' kernels as inductor's CPU backend generates "
              "them, fewer than a GPU launches (docs/efficiency.md)") if compiled else ""
    finding = (
        f"`{path.name}` (`python -m repro study router-costs --out results/bench`), launches per router call, forward + backward on a "
        f"non-logging step: {launches}{caveat}; host synchronisations in all of them together: {syncs}."
    )
    table = [f"### `{path.name}`", "", f"See [`{path.stem}.md`]({path.stem}.md).", ""]
    return [finding], [finding], table


def bench(directory: Path) -> Writeup:
    """``results/bench``: pytest-benchmark JSONs (single-run medians: no tests) and router cost counts."""
    findings, key, tables = [], [], ["## Tables", ""]
    for path in sorted(directory.glob("*.json"), key=lambda p: (p.name != "routers.json", p.name)):
        f, k, table = (_costs_file if path.name == "router_costs.json" else _bench_file)(path)
        findings, key, tables = findings + f, key + k, tables + table
    readme = page("Micro-benchmarks (pytest-benchmark; medians of one run each, no test)", BENCH_COMMAND, findings, [], tables)
    return Writeup(directory.name, readme, "\n".join(f"- {line}" for line in (*key, link(directory.name))))
