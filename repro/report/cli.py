"""``python -m repro report tables`` and ``python -m repro report check`` (examples: docs/evaluation.md)."""

from __future__ import annotations

import argparse
import sys
from operator import attrgetter
from pathlib import Path

from repro.errors import ReproError
from repro.io_utils import comma_list


def tables_main(argv: list[str], prog: str) -> int:
    """Build the zero-shot, efficiency and routing tables from run records. Returns the exit status (0)."""
    from repro.records.store import load_records
    from repro.report.compute_parity import DEFAULT_PARITY_TOLERANCE, DEFAULT_REFERENCE_ROUTER
    from repro.report.published import load_ledger
    from repro.report.seed_tables import compare_over_seeds, seed_zero_shot_table
    from repro.report.table_core import FORMATS, ZERO_SHOT_METRICS, render, write_tables
    from repro.report.tables import efficiency_table, routing_table, zero_shot_table

    parser = argparse.ArgumentParser(prog=prog, description="Build the paper's tables from run records.")
    parser.add_argument("records", nargs="+", help="record files (record.json, *.record.json) or directories of them")
    parser.add_argument("--published", action="store_true", help="show published numbers and deltas beside the runs")
    parser.add_argument("--ledger", default=None, help="published-number directory (default: results/published)")
    parser.add_argument("--out", default=None, help="write <table>.<format> files here (default: Markdown to stdout)")
    parser.add_argument("--format", type=comma_list, default=list(FORMATS), help="with --out: any of md,csv,tex")
    parser.add_argument(
        "--metric", choices=ZERO_SHOT_METRICS, default="auto",
        help="zero-shot metric: acc, acc_norm, or auto (acc_norm where the task reports it, acc otherwise)",
    )
    parser.add_argument("--parity-tolerance", type=float, default=DEFAULT_PARITY_TOLERANCE,
                        help="relative tolerance on measured expert FLOPs per token (default 0.05)")
    parser.add_argument("--reference-router", default=DEFAULT_REFERENCE_ROUTER,
                        help="compute-parity reference router, and with --over-seeds the router tested against")
    parser.add_argument(
        "--over-seeds", action="store_true",
        help="add a zero-shot table with one row per router over its runs (seeds): mean +- 95%% CI, "
        "* where it differs from --reference-router (paired t over shared seeds)",
    )
    parser.add_argument("--family", choices=("table", "column"), default="table",
                        help="with --over-seeds: Holm family of the marks, every test of the table (default) or each column")
    args = parser.parse_args(argv)

    records = load_records(args.records)
    ledger = load_ledger(args.ledger) if args.published else None
    tables = [
        zero_shot_table(records, metric=args.metric, ledger=ledger),
        efficiency_table(records, ledger=ledger, parity_tolerance=args.parity_tolerance,
                         reference_router=args.reference_router),
        routing_table(records),
    ]
    if args.over_seeds:
        comparison = compare_over_seeds(records, reference_router=args.reference_router, metric=args.metric,
                                        family=args.family)
        tables.insert(1, seed_zero_shot_table(comparison))
    empty = [t.name for t in tables if not t.rows]
    if empty:  # e.g. runs not evaluated yet: say so rather than print or write an empty table
        print(f"no rows for: {', '.join(empty)} (no run has the figures they need)", file=sys.stderr)
    tables = [t for t in tables if t.rows]
    if args.out is None:
        print("\n".join(render(t, "md") for t in tables), end="")
        return 0
    for path in write_tables(tables, args.out, args.format):
        print(f"wrote {path}")
    return 0


def check_main(argv: list[str], prog: str) -> int:
    """Regression-check runs against published numbers or earlier runs. Returns 1 if out of tolerance, else 0."""
    from repro.records.store import load_records
    from repro.report.check import (
        CheckReport,
        check_against_published,
        check_against_run,
        check_against_seeds,
        render_report,
    )
    from repro.report.published import load_ledger

    parser = argparse.ArgumentParser(
        prog=prog, description="Compare a run with the published numbers or an earlier run; exit 1 on a deviation."
    )
    parser.add_argument("run", help="a record file or a directory of records")
    parser.add_argument(
        "--against", required=True,
        help="'published', or an earlier run's record file / directory; a directory with two or more runs of the "
        "same experiment (seeds) is a band: each number must fall in their prediction interval",
    )
    parser.add_argument("--ledger", default=None, help="published-number directory (default: results/published)")
    parser.add_argument("--paper", default=None, help="with --against published: only this paper's numbers (e.g. ReMoE)")
    parser.add_argument("--metric", choices=("auto", "acc", "acc_norm"), default="auto",
                        help="zero-shot metric compared with the papers (default auto: acc_norm where reported)")
    parser.add_argument("--loss-rtol", type=float, default=1e-6, help="against a run: loss tolerance (default 1e-6)")
    parser.add_argument("--eval-rtol", type=float, default=1e-6, help="against a run: lm-eval tolerance (default 1e-6)")
    parser.add_argument("--alpha", type=float, default=0.05,
                        help="against seeds: family-wise false-alarm rate over all numbers compared (default 0.05; "
                        "each number's prediction interval at 1 - alpha/K)")
    args = parser.parse_args(argv)
    if not 0 < args.alpha < 1:
        raise ReproError(f"--alpha must be in (0, 1), got {args.alpha}")

    records = load_records([args.run])
    reports: list[CheckReport] = []
    if args.against == "published":
        ledger = load_ledger(args.ledger)
        for record in records:
            report = check_against_published(record, ledger, zero_shot_metric=args.metric, paper=args.paper)
            if not report.rows:
                raise ReproError(
                    f"no published number for run '{record.run_id}' (router '{record.experiment.router}', "
                    f"model '{record.experiment.model}'): the ledger covers models "
                    f"{', '.join(sorted({e.setting.model_id for e in ledger}))}"
                )
            reports.append(report)
    else:
        earlier_runs = load_records([args.against])
        previous = {r.run_id: r for r in earlier_runs}
        same = attrgetter("experiment.name", "experiment.router", "experiment.model")  # what a run's seeds share
        for record in records:
            seeds = [r for r in earlier_runs if same(r) == same(record) and r != record]
            if len(seeds) >= 2:
                reports.append(check_against_seeds(record, seeds, alpha=args.alpha))
                continue
            if record.run_id in previous:
                earlier = previous[record.run_id]
            elif len(records) == 1 and len(previous) == 1:
                earlier = next(iter(previous.values()))  # one run against one run: ids may differ
            else:
                raise ReproError(f"{Path(args.against)}: no earlier run with run_id '{record.run_id}'")
            reports.append(check_against_run(record, earlier, loss_rtol=args.loss_rtol, eval_rtol=args.eval_rtol))
    headers = list(dict.fromkeys(report.header for report in reports if report.header))
    merged = CheckReport(tuple(row for report in reports for row in report.rows), "\n".join(headers))
    print(render_report(merged), end="")
    if merged.compared == 0:
        raise ReproError("nothing was compared: every number was skipped (see the notes above)")
    return 0 if merged.passed else 1
