"""``python -m repro report bench BENCH.json``: summarise a pytest-benchmark JSON.

One row per benchmark: group, router, median time, and its ratio to ``switch``'s median in the same group. The
router comes from ``extra_info["router"]``, else the ``name`` parameter, else the ``[...]`` part of the name.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from repro.errors import ReproError
from repro.io_utils import atomic_path
from repro.report.published import load_json

BASELINE = "switch"


@dataclass(frozen=True)
class BenchRow:
    """One benchmark: group, router, median time per round, ratio to the group's baseline (None: none)."""

    group: str
    router: str
    median_s: float
    ratio_to_baseline: float | None


def _router_of(bench: dict) -> str:
    extra = bench.get("extra_info") or {}
    params = bench.get("params") or {}
    if isinstance(extra.get("router"), str):
        return extra["router"]
    if isinstance(params.get("name"), str):
        return params["name"]
    name = str(bench.get("name", "?"))
    return name[name.index("[") + 1 : name.rindex("]")] if "[" in name and name.endswith("]") else name


def summarise(data: dict, baseline: str = BASELINE, origin: str = "benchmark JSON") -> list[BenchRow]:
    """Median time per benchmark and its ratio to the baseline router.

    Args:
        data: parsed pytest-benchmark JSON (``{"benchmarks": [{"name", "group", "stats": {"median"}}, ...]}``).
        baseline: the router others are divided by.
        origin: what to name in errors.

    Returns:
        Rows sorted by group, then median time.

    Raises:
        ReproError: no ``benchmarks`` list, or a benchmark without a numeric ``stats.median``.
    """
    benches = data.get("benchmarks") if isinstance(data, dict) else None
    if not isinstance(benches, list):
        raise ReproError(f"{origin}: not a pytest-benchmark JSON (no 'benchmarks' list)")
    parsed = []
    for i, bench in enumerate(benches):
        median = (bench.get("stats") or {}).get("median") if isinstance(bench, dict) else None
        if isinstance(median, bool) or not isinstance(median, (int, float)):
            raise ReproError(f"{origin}: benchmark {i} has no numeric 'stats.median'")
        parsed.append((str(bench.get("group") or ""), _router_of(bench), float(median)))
    base = {group: median for group, router, median in parsed if router == baseline}
    rows = [
        BenchRow(group, router, median, median / base[group] if group in base and base[group] > 0 else None)
        for group, router, median in parsed
    ]
    return sorted(rows, key=lambda r: (r.group, r.median_s))


def render_bench(rows: list[BenchRow], baseline: str = BASELINE) -> str:
    """GitHub-Markdown table of :func:`summarise`'s rows; ``baseline`` names the ratio's header."""
    cells = [
        (r.group, r.router, f"{r.median_s * 1e3:.3f}", "--" if r.ratio_to_baseline is None else f"{r.ratio_to_baseline:.2f}")
        for r in rows
    ]
    headers = ("group", "router", "median (ms)", f"x {baseline}")
    return tabulate(cells, headers=headers, tablefmt="github", disable_numparse=True) + "\n"


def main(argv: list[str], prog: str) -> int:
    """Print (and optionally write) the benchmark summary. Returns the exit status (0)."""
    parser = argparse.ArgumentParser(prog=prog, description="Summarise a pytest-benchmark JSON as a table.")
    parser.add_argument("json", help="pytest-benchmark JSON (--benchmark-json)")
    parser.add_argument("--baseline", default=BASELINE, help="router the ratios are relative to (default switch)")
    parser.add_argument("--out", default=None, help="also write the Markdown table here")
    args = parser.parse_args(argv)
    path = Path(args.json)
    text = render_bench(summarise(load_json(path, "benchmark JSON"), args.baseline, str(path)), args.baseline)
    print(text, end="")
    if args.out:
        # Replace only an earlier table of this command (recognised by its header row), never another file.
        header = text.splitlines()[0]
        with atomic_path(args.out, replace=lambda p: p.is_file() and p.read_text().startswith(header)) as tmp:
            tmp.write_text(text)
    return 0
