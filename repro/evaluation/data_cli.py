"""``python -m repro eval-data fetch|check``: fill (with network access) or check a task-data folder for
``python -m repro eval --tasks-data`` (:mod:`repro.evaluation.task_data`, docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from repro.cli import comma_list
from repro.errors import ReproError

_ON = ("1", "on", "yes", "true")


def main(argv: list[str], prog: str) -> int:
    """Run ``fetch`` or ``check``; returns the exit status."""
    # Not from runner.py: importing it switches the process to offline mode, and fetch downloads.
    from repro.evaluation.task_data import PAPER_TASK_DIRS

    paper_tasks = list(PAPER_TASK_DIRS)
    parser = argparse.ArgumentParser(prog=prog, description="Fill or check a task-data folder for `eval --tasks-data`.")
    sub = parser.add_subparsers(dest="action", required=True)
    fetch_p = sub.add_parser("fetch", help="download the tasks' hub datasets into a task-data folder (needs network)")
    fetch_p.add_argument("--out", required=True, help="the task-data folder to fill")
    fetch_p.add_argument("--dry-run", action="store_true", help="print what would be downloaded, download nothing")
    check_p = sub.add_parser("check", help="check offline that a task-data folder holds every task's data")
    check_p.add_argument("folder", help="the task-data folder")
    for p in (fetch_p, check_p):
        p.add_argument("--tasks", type=comma_list, default=paper_tasks,
                       help=f"comma-separated lm-eval tasks (default: {','.join(paper_tasks)})")
    args = parser.parse_args(argv)

    from repro.evaluation.task_data import check_task_data, fetch, fetch_plan, task_data_specs

    specs = task_data_specs(args.tasks)
    if args.action == "check":
        with tempfile.TemporaryDirectory(prefix="repro-task-data-") as scratch:
            check_task_data(specs, args.folder, scratch)
        print(f"{args.folder}: data for {', '.join(args.tasks)} is complete")
        return 0
    plan = fetch_plan(specs)
    for item in plan:
        print(item.describe(args.out))
    if args.dry_run:
        return 0
    offline = [v for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if os.environ.get(v, "").lower() in _ON]
    if offline:
        raise ReproError(f"fetch downloads from the Hugging Face hub, but {' and '.join(offline)} is set: unset it")
    fetch(plan, args.out)
    return 0
