"""Run lm-eval's ``simple_evaluate`` on an LM, offline, on full-scale and/or local tasks.

Full-scale tasks read their datasets from the local cache or a task-data folder
(:mod:`repro.evaluation.task_data`). Results are returned only when every task was scored, never partial.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from repro.evaluation.offline import ensure_offline

ensure_offline()

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import handle_non_serializable  # noqa: E402

from repro.errors import ReproError  # noqa: E402
from repro.evaluation.local_tasks import LOCAL_TAG  # noqa: E402
from repro.evaluation.task_data import PAPER_TASK_DIRS, task_manager_for  # noqa: E402

#: The papers' zero-shot tasks (need their Hugging Face datasets in a task-data folder or the local cache).
FULL_SCALE_TASKS = tuple(PAPER_TASK_DIRS)


def evaluate_lm(lm: LM, tasks: Sequence[str] | None = None, *, local_tasks: str | Path | None = None,
                tasks_data: str | Path | None = None, task_manager: TaskManager | None = None,
                limit: int | float | None = None, bootstrap_iters: int = 1000, seed: int = 1234,
                log_samples: bool = False) -> dict[str, Any]:
    """Zero-shot evaluation through lm-eval, with no network access.

    Args:
        lm: the model (e.g. :class:`repro.evaluation.harness.SuiteLM`).
        tasks: default tag ``minipile`` given ``local_tasks`` and no ``tasks_data``, else :data:`FULL_SCALE_TASKS`.
        local_tasks, tasks_data: a local-task directory; a task-data folder for the other tasks.
        task_manager: a TaskManager to reuse (default: :func:`task_manager_for`; not with ``tasks_data``).
        limit, seed: documents per task (lm-eval's ``limit``); lm-eval's python / numpy / torch / few-shot seeds.
        bootstrap_iters: standard errors on (> 0) or off (0); the count matters only for bootstrapped metrics.
        log_samples: keep per-document records under ``samples`` (:func:`repro.stats.per_question_scores`).

    Returns:
        lm-eval's results dict as plain JSON values.

    Raises:
        ReproError: unknown task, task data unavailable offline, or a task without a result.
    """
    if tasks is None:
        tasks = [LOCAL_TAG] if local_tasks is not None and tasks_data is None else list(FULL_SCALE_TASKS)
    if tasks_data is not None and task_manager is not None:
        raise ReproError("pass either tasks_data or task_manager, not both")
    with tempfile.TemporaryDirectory(prefix="repro-task-data-") as work:
        manager = task_manager or task_manager_for(tasks, local_tasks, tasks_data, work)
        if unknown := [t for t in tasks if t not in manager.all_tasks]:
            raise ReproError(f"unknown lm-eval task(s): {', '.join(unknown)}")
        try:
            results = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                      bootstrap_iters=bootstrap_iters, log_samples=log_samples, random_seed=seed,
                                      numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
        except ConnectionError as exc:
            raise ReproError(f"task data is not available offline ({exc}). The full-scale tasks need their Hugging "
                             "Face datasets in a task-data folder (--tasks-data DIR; fill it with `python -m repro "
                             "eval fetch --out DIR` on a machine with network access) or in the local datasets "
                             "cache; on the embedded default use --local-tasks") from None
    if results is None:  # not rank 0
        return {}
    leaves: set[str] = set()  # the tasks ``tasks`` stand for (a tag: its tasks; a group: its name only)
    for name in tasks:
        entry = manager.task_index.get(name)
        leaves |= set(entry.tags) if entry is not None and entry.kind.name == "TAG" else {name}
    if missing := sorted(leaves - set(results.get("results", {}))):
        raise ReproError(f"lm-eval returned no result for task(s) {', '.join(missing)}: nothing is reported")
    # Plain JSON values, as lm-eval serialises them.
    return json.loads(json.dumps(results, default=handle_non_serializable))
