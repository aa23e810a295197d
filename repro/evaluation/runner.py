"""Run lm-eval's ``simple_evaluate`` on an LM, offline, on full-scale and/or local tasks."""

from __future__ import annotations

import json
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

#: The papers' zero-shot tasks (need their Hugging Face datasets in the local cache).
FULL_SCALE_TASKS = ("arc_challenge", "arc_easy", "boolq", "hellaswag", "lambada_openai", "piqa", "race")


def task_manager_for(tasks: Sequence[str], local_tasks: str | Path | None) -> TaskManager:
    """A TaskManager that knows ``tasks``, scanning lm-eval's own task tree only when needed (it takes seconds).

    Args:
        tasks: task, group or tag names.
        local_tasks: a directory written by :func:`repro.evaluation.local_tasks.build_local_tasks`.

    Returns:
        The TaskManager.

    Raises:
        ReproError: a missing local-task directory.
    """
    if local_tasks is not None:
        if not Path(local_tasks).is_dir():
            raise ReproError(f"{local_tasks}: no such local-task directory")
        local = TaskManager(include_path=str(local_tasks), include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=None if local_tasks is None else str(local_tasks))


def evaluate_lm(
    lm: LM,
    tasks: Sequence[str] | None = None,
    *,
    local_tasks: str | Path | None = None,
    task_manager: TaskManager | None = None,
    limit: int | float | None = None,
    bootstrap_iters: int = 1000,
    seed: int = 1234,
) -> dict[str, Any]:
    """Zero-shot evaluation through lm-eval, with no network access.

    Args:
        lm: the model (e.g. :class:`repro.evaluation.harness.SuiteLM`).
        tasks: task names; default: the local tasks (tag ``minipile``) with ``local_tasks``, else
            :data:`FULL_SCALE_TASKS`.
        local_tasks: a local-task directory.
        task_manager: a TaskManager to reuse (default: :func:`task_manager_for`).
        limit: documents per task (for quick checks; lm-eval's ``limit``).
        bootstrap_iters: bootstrap resamples for standard errors (0: none).
        seed: lm-eval's python / numpy / torch / few-shot seeds.

    Returns:
        lm-eval's results dict as JSON-ready plain values (``results``, ``configs``, ``versions``, ...).

    Raises:
        ReproError: unknown task, or task data that is not available offline.
    """
    if tasks is None:
        tasks = [LOCAL_TAG] if local_tasks is not None else list(FULL_SCALE_TASKS)
    manager = task_manager or task_manager_for(tasks, local_tasks)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ReproError(f"unknown lm-eval task(s): {', '.join(unknown)}")
    try:
        results = simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except ConnectionError as exc:
        raise ReproError(
            f"task data is not available offline ({exc}). The full-scale tasks need their Hugging Face datasets "
            "in the local datasets cache (fill it once on a machine with network access, then copy "
            "~/.cache/huggingface); on the embedded default use --local-tasks"
        ) from None
    if results is None:  # not rank 0
        return {}
    # lm-eval's dict holds numpy scalars and other objects; lm-eval serialises them this way too.
    return json.loads(json.dumps(results, default=handle_non_serializable))
