"""``python -m repro eval fetch|check``: fill (with network access) or check a task-data folder for
``python -m repro eval --tasks-data`` (:mod:`repro.evaluation.task_data`, docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import os

from repro.errors import ReproError
from repro.io_utils import comma_list


def _parser(prog: str, action: str) -> argparse.ArgumentParser:
    # Not from runner.py: importing it switches to offline mode, and fetch downloads.
    from repro.evaluation.task_data import PAPER_TASK_DIRS

    paper_tasks = list(PAPER_TASK_DIRS)
    what = ("Download lm-eval tasks' hub datasets into a task-data folder for `eval --tasks-data` (needs network)."
            if action == "fetch" else "Check offline that a task-data folder holds every task's data.")
    p = argparse.ArgumentParser(prog=prog, description=what)
    if action == "fetch":
        p.add_argument("--out", required=True, help="the task-data folder to fill")
        p.add_argument("--dry-run", action="store_true", help="print what would be downloaded, download nothing")
    else:
        p.add_argument("folder", help="the task-data folder")
    p.add_argument("--tasks", type=comma_list, default=paper_tasks,
                   help=f"comma-separated lm-eval tasks (default: {','.join(paper_tasks)})")
    return p


def check_main(argv: list[str], prog: str) -> int:
    """``eval check FOLDER``: exit status 0 when the folder holds every task's data (else a ReproError)."""
    args = _parser(prog, "check").parse_args(argv)
    from repro.evaluation.task_data import check_task_data, task_data_specs

    check_task_data(task_data_specs(args.tasks), args.folder)
    print(f"{args.folder}: data for {', '.join(args.tasks)} is complete")
    return 0


def fetch_main(argv: list[str], prog: str) -> int:
    """``eval fetch --out FOLDER``: download the tasks' datasets (or, with ``--dry-run``, list them)."""
    args = _parser(prog, "fetch").parse_args(argv)
    from repro.evaluation.task_data import fetch, fetch_plan, task_data_specs

    plan = fetch_plan(task_data_specs(args.tasks))
    for item in plan:
        print(item.describe(args.out))
    if args.dry_run:
        return 0
    offline = [v for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
               if os.environ.get(v, "").lower() in ("1", "on", "yes", "true")]
    if offline:
        raise ReproError(f"fetch downloads from the Hugging Face hub, but {' and '.join(offline)} is set: unset it")
    fetch(plan, args.out)
    return 0
