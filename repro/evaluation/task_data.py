"""The papers' zero-shot tasks from data on disk: lm-eval's own task definitions, local datasets.

A *task-data folder* (docs/evaluation.md) holds one local dataset repository per hub dataset: :func:`fetch`
fills it online, :func:`task_manager_for` evaluates on it offline. Tasks read what lm-eval's installed YAML
names, *every* split required (the few-shot sampler needs the training split even at 0 shots). ``datasets``
resolves local folders only relative to the working directory, hence :func:`write_task_overrides`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from repro.errors import ReproError
from repro.io_utils import atomic_path

#: The papers' tasks and their lm-eval task folders (indexing these is much faster than the whole tree).
PAPER_TASK_DIRS: dict[str, str] = {"arc_challenge": "arc", "arc_easy": "arc", "boolq": "super_glue/boolq",
                                   "hellaswag": "hellaswag", "lambada_openai": "lambada", "piqa": "piqa",
                                   "race": "race"}
CARD = "README.md"
#: Config folder name of a task whose YAML names no config (``dataset_name: null``).
DEFAULT_CONFIG = "default"
_SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
_PACKAGED_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow", "pandas", "webdataset", "xml", "sql"})


@dataclass(frozen=True)
class TaskData:
    """What one lm-eval task's YAML reads from the hub: dataset, config, all splits, scored split, kwargs."""

    task: str
    yaml_path: Path
    dataset_path: str
    dataset_name: str | None
    splits: tuple[str, ...]
    eval_split: str
    dataset_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def folder(self, root: str | Path) -> Path:
        return Path(root).resolve() / self.dataset_path


def _task_index(tasks: Sequence[str]) -> Mapping[str, Any]:
    """lm-eval's index entries (name -> Entry with ``kind``, ``yaml_path``, ``cfg``) covering ``tasks``."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    root = Path(lm_eval.tasks.__file__).parent
    folders = sorted({root / PAPER_TASK_DIRS[t] for t in tasks if t in PAPER_TASK_DIRS})
    index = TaskManager(include_path=folders, include_defaults=False).task_index if folders else {}
    if any(t not in index for t in tasks):
        index = TaskManager().task_index
    return index


def _spec_from_entry(task: str, entry: Any) -> TaskData:
    if entry.kind.name != "TASK" or entry.yaml_path is None:
        raise ReproError(f"'{task}' is an lm-eval {entry.kind.name.lower()}, not a task: name its tasks instead")
    cfg = entry.cfg or {}
    path = cfg.get("dataset_path")
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    if (not isinstance(path, str) or cfg.get("custom_dataset") is not None or path in _PACKAGED_BUILDERS
            or Path(path).is_absolute() or ".." in Path(path).parts):
        raise ReproError(f"task '{task}' does not read a Hugging Face hub dataset ({entry.yaml_path}); --tasks-data cannot serve it")
    if "data_files" in kwargs or "data_dir" in kwargs:
        raise ReproError(f"task '{task}' names its own data files in {entry.yaml_path}; --tasks-data cannot serve it")
    fewshot = cfg.get("fewshot_config") or {}
    named = [cfg.get(k) for k in _SPLIT_KEYS] + [fewshot.get("split") if isinstance(fewshot, Mapping) else None]
    splits = tuple(dict.fromkeys(s for s in named if isinstance(s, str)))
    eval_split = cfg.get("test_split") or cfg.get("validation_split")
    if not eval_split:
        raise ReproError(f"task '{task}' names no test or validation split in {entry.yaml_path}")
    name = cfg.get("dataset_name")
    return TaskData(task, Path(entry.yaml_path), path, None if name is None else str(name), splits, eval_split, kwargs)


def task_data_specs(tasks: Sequence[str]) -> list[TaskData]:
    """One :class:`TaskData` per lm-eval task, in order (ReproError: an unknown name, a group or tag, or a task
    that does not read a hub dataset)."""
    if not tasks:
        raise ReproError("no tasks given")
    index = _task_index(tasks)
    if unknown := [t for t in tasks if t not in index]:
        raise ReproError(f"unknown lm-eval task(s): {', '.join(unknown)}")
    return [_spec_from_entry(t, index[t]) for t in tasks]


def _fetch_hint(root: Path, tasks: Iterable[str]) -> str:
    return (f"fill it on a machine with network access: "
            f"python -m repro eval fetch --out {root} --tasks {','.join(tasks)}")


def _missing_data(spec: TaskData, root: Path) -> str | None:
    """Why ``spec``'s data is not usable in ``root``, naming the folder (None: usable)."""
    import datasets

    folder, config = spec.folder(root), spec.dataset_name or DEFAULT_CONFIG
    if not (folder / CARD).is_file():
        return f"task '{spec.task}': no {spec.dataset_path} in {folder}"
    try:
        # datasets' own resolution: configs and data files from the card (its cache is thrown away).
        with tempfile.TemporaryDirectory(prefix="repro-task-data-") as cache:
            builder = datasets.load_dataset_builder(str(folder), spec.dataset_name, cache_dir=cache)
    except (ValueError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"task '{spec.task}': {folder} has no usable config '{config}' ({reason})"
    have = list((builder.config.data_files or {}).keys())
    if lacking := [s for s in spec.splits if s not in have]:
        return (f"task '{spec.task}': {folder} config '{config}' lacks split(s) {', '.join(lacking)} "
                f"(has: {', '.join(have) or 'none'})")
    return None


def check_task_data(specs: Sequence[TaskData], root: str | Path) -> None:
    """Check ``root`` holds every config and split ``specs`` read (ReproError naming each task lacking data)."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise ReproError(f"{root}: no such task-data folder ({_fetch_hint(root, [s.task for s in specs])})")
    problems = [(s.task, p) for s in specs if (p := _missing_data(s, root)) is not None]
    if problems:
        raise ReproError(f"{'; '.join(p for _, p in problems)} ({_fetch_hint(root, [t for t, _ in problems])})")


def write_task_overrides(specs: Sequence[TaskData], root: str | Path, out_dir: str | Path) -> Path:
    """One YAML per task in ``out_dir``, overriding only ``dataset_path`` and cache; returns ``out_dir`` absolute."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        config = {"include": str(spec.yaml_path), "task": spec.task, "dataset_path": str(spec.folder(root)),
                  "dataset_kwargs": {**spec.dataset_kwargs, "cache_dir": str(out / ".hf_cache")}}
        (out / f"{spec.task}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def task_manager_for(tasks: Sequence[str], local_tasks: str | Path | None, tasks_data: str | Path | None = None,
                     work_dir: str | Path | None = None) -> Any:
    """A TaskManager knowing ``tasks`` and ``local_tasks``, scanning lm-eval's slow task tree only if needed.

    Args:
        tasks, local_tasks: lm-eval task names; a local-task directory (ReproError if missing) or None.
        tasks_data, work_dir: a task-data folder the tasks not in ``local_tasks`` read from; scratch for it.
    """
    from lm_eval.tasks import TaskManager

    local = None
    if local_tasks is not None:
        if not Path(local_tasks).is_dir():
            raise ReproError(f"{local_tasks}: no such local-task directory")
        local = TaskManager(include_path=str(local_tasks), include_defaults=False)
    wanted = [t for t in tasks if local is None or t not in local.all_tasks]
    if local is not None and not wanted:
        return local
    if tasks_data is None:
        return TaskManager(include_path=None if local_tasks is None else str(local_tasks))
    specs = task_data_specs(wanted)
    check_task_data(specs, tasks_data)
    paths = [str(write_task_overrides(specs, tasks_data, Path(work_dir) / "tasks"))]
    return TaskManager(include_path=paths + ([] if local_tasks is None else [str(local_tasks)]),
                       include_defaults=False)


@dataclass(frozen=True)
class DatasetPlan:
    """One hub dataset to fetch: ``(dataset_name, splits)`` per config the ``tasks`` read (None: default)."""

    dataset_path: str
    configs: tuple[tuple[str | None, tuple[str, ...]], ...]
    tasks: tuple[str, ...]

    def describe(self, root: str | Path) -> str:
        configs = ", ".join(f"{name or DEFAULT_CONFIG} [{', '.join(splits)}]" for name, splits in self.configs)
        return f"{self.dataset_path}: {configs} -> {Path(root) / self.dataset_path} (tasks: {', '.join(self.tasks)})"


def fetch_plan(specs: Sequence[TaskData]) -> list[DatasetPlan]:
    """One :class:`DatasetPlan` per hub dataset of ``specs``, in first-seen order, its configs grouped."""
    grouped: dict[str, dict[str | None, list[str]]] = {}
    owners: dict[str, list[str]] = {}
    for spec in specs:
        splits = grouped.setdefault(spec.dataset_path, {}).setdefault(spec.dataset_name, [])
        splits.extend(s for s in spec.splits if s not in splits)
        owners.setdefault(spec.dataset_path, []).append(spec.task)
    return [DatasetPlan(path, tuple((name, tuple(splits)) for name, splits in configs.items()), tuple(owners[path]))
            for path, configs in grouped.items()]


def dataset_card(plan: DatasetPlan, note: str) -> str:
    """The ``README.md`` of a local dataset folder: a YAML header listing each config's files, then ``note``."""
    configs = [{"config_name": name or DEFAULT_CONFIG,
                "data_files": [{"split": s, "path": f"{name or DEFAULT_CONFIG}/{s}.jsonl"} for s in splits]}
               for name, splits in plan.configs]
    header = yaml.safe_dump({"configs": configs}, sort_keys=False)
    return f"---\n{header}---\n\n{note.rstrip()}\n"


def fetch(plan: Sequence[DatasetPlan], out: str | Path, *,
          load: Callable[[str, str | None], Mapping[str, Any]] | None = None,
          log: Callable[[str], None] = print) -> list[Path]:
    """Download ``plan`` atomically into ``out``; an existing folder is kept if complete, refused otherwise.

    Args:
        load: ``(dataset_path, dataset_name) -> {split: datasets.Dataset}``; default ``datasets.load_dataset``.
        log: progress messages.

    Returns:
        The dataset folders written (folders kept as they were are not listed).

    Raises:
        ReproError: an incomplete existing folder, or a dataset without a split the tasks read.
    """
    import datasets

    load = load or (lambda path, name: datasets.load_dataset(path, name))
    root = Path(out).resolve()
    written = []
    for item in plan:
        dest = root / item.dataset_path
        if dest.exists():
            if any(_missing_data(TaskData("fetch", Path(), item.dataset_path, n, s, s[0]), root) is not None
                   for n, s in item.configs):
                raise ReproError(f"{dest} exists but lacks some of {item.describe(root)}; it is left as it is: "
                                 "remove it or fetch into another folder")
            log(f"kept {dest} (complete)")
            continue
        with atomic_path(dest) as tmp:
            counts = []  # "config: split rows, ..." per config, for the card
            for name, splits in item.configs:
                config = name or DEFAULT_CONFIG
                log(f"downloading {item.dataset_path} {config} ...")
                data = load(item.dataset_path, name)
                if missing := [s for s in splits if s not in data]:
                    raise ReproError(f"{item.dataset_path} config '{config}' has no split(s) "
                                     f"{', '.join(missing)} (has: {', '.join(data)})")
                (tmp / config).mkdir(parents=True, exist_ok=True)
                for split in splits:
                    data[split].to_json(str(tmp / config / f"{split}.jsonl"))
                counts.append(f"{config}: " + ", ".join(f"{s} {len(data[s])}" for s in splits))
            note = (f"Local copy of the Hugging Face dataset `{item.dataset_path}` for lm-eval's tasks "
                    f"{', '.join(item.tasks)}, written by `python -m repro eval fetch` with datasets "
                    f"{datasets.__version__}. Rows: {'; '.join(counts)}.")
            (tmp / CARD).write_text(dataset_card(item, note))
        log(f"wrote {dest}")
        written.append(dest)
    return written
