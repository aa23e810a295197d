"""A run directory: its files, its lock, and what a command may do with it: a fresh run, ``--resume`` (changing
only :data:`CHANGEABLE_ON_RESUME`, noted in ``resume_changes.json``) or ``--extend`` (the rules: docs/failures.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repro.config import RunConfig
from repro.errors import ReproError
from repro.io_utils import write_json_atomic
from repro.records.step_log import LOG_FILE
from repro.schema import flatten
from repro.training import checkpoint as ckpt

LOCK_FILE = ".lock"
#: What a resumed run may change (the trainer checks that the backend resolves to the run's own).
CHANGEABLE_ON_RESUME: tuple[str, ...] = (
    "optimizer", "schedule", "checkpoint", "logging", "validation", "model.backend", "model.backend_options",
)


@dataclass(frozen=True)
class RunPaths:
    """Where a run writes: the run directory ``root`` and its files."""

    root: Path

    config = property(lambda self: self.root / "config.json")
    log = property(lambda self: self.root / LOG_FILE)
    checkpoints = property(lambda self: self.root / "checkpoints")
    summary = property(lambda self: self.root / "summary.json")
    data_cache = property(lambda self: self.root / "data_cache")  # megatron's dataset index cache (indexed data)


@contextlib.contextmanager
def run_lock(paths: RunPaths) -> Iterator[None]:
    """Hold the run's exclusive ``flock`` on ``.lock`` (rank 0 only; the OS releases it on any exit); ReproError
    if the directory cannot be created or another process holds it."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    try:
        paths.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(paths.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ReproError(f"{paths.root}: cannot use as a run directory: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            raise ReproError(
                f"{paths.root}: another run is using this directory (process {holder}); wait for it to end or "
                "choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def stored_config(paths: RunPaths) -> tuple[RunConfig, ckpt.CheckpointInfo | None]:
    """The run's config and newest checkpoint (None: none): the checkpoint's config, else ``config.json``'s
    (ReproError: no run, unreadable)."""
    latest = ckpt.find_latest_checkpoint(paths.checkpoints)
    if latest is not None:
        info = ckpt.read_checkpoint_info(latest)
        return RunConfig.from_dict(info.experiment, origin=str(latest / "meta.json")), info
    if not paths.config.is_file():
        raise ReproError(f"{paths.root}: no run to resume here (no checkpoint and no config.json)")
    try:
        data = json.loads(paths.config.read_text())["experiment"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReproError(f"{paths.config}: not a run's config.json ({type(exc).__name__}: {exc})") from None
    return RunConfig.from_dict(data, origin=str(paths.config)), None


def config_changes(stored: RunConfig, given: RunConfig) -> dict[str, str]:
    """``{"section.field": "old -> new"}`` for every leaf that differs between two configs."""
    old, new = flatten(stored.to_dict(), keep=("options",)), flatten(given.to_dict(), keep=("options",))
    keys = sorted(old.keys() | new.keys())
    return {k: f"{old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)}


def start_state(
    paths: RunPaths, config: RunConfig | None, resume: bool, extend: bool = False
) -> tuple[RunConfig, ckpt.CheckpointInfo | None, dict[str, Any] | None]:
    """How a run starts in ``paths.root``. On resume explicit changes are printed and kept in
    ``resume_changes.json``; a finished run is left as it is unless ``extend``, which continues it and removes its
    ``summary.json``/``record.json`` (rewritten at the end) so no record describes a shorter run.

    Returns:
        ``(config, checkpoint to resume from (None: step 0), the summary if the run had already finished)``.

    Raises:
        ReproError: foreign directory, nothing to resume, model-changing resume, or a bad ``extend``.
    """
    if not resume:
        if extend:
            raise ReproError("--extend continues a finished run: it needs --resume")
        if config is None:
            raise ReproError("no experiment given")
        children = paths.root.iterdir() if paths.root.is_dir() else []
        entries = sorted(p.name for p in children if not p.name.startswith("."))
        if entries:
            if paths.config.is_file() or paths.log.is_file() or paths.checkpoints.is_dir():
                raise ReproError(f"{paths.root}: already holds a run; pass --resume to continue it (from step 0 if it "
                                 "has no checkpoint yet) or choose another --out")
            more = ", ..." if len(entries) > 3 else ""
            raise ReproError(f"{paths.root}: is not empty ({', '.join(entries[:3])}{more}); a fresh run needs a new "
                             "or empty --out")
        return config, None, None

    stored, info = stored_config(paths)
    changes = {} if config is None else config_changes(stored, config)
    frozen = [
        k for k in changes
        if not any(k == c or k.startswith(c + ".") for c in CHANGEABLE_ON_RESUME) or k == "checkpoint.init_from"
    ]
    if frozen:
        raise ReproError(f"{info.path if info else paths.config}: --resume cannot change what defines the model or "
                         f"its data ({'; '.join(f'{k}: {changes[k]}' for k in frozen)}); start a new run "
                         "(--set checkpoint.init_from=<this run> starts one from these weights)")
    config = stored if config is None else config
    finished = info is not None and info.step >= stored.schedule.steps and paths.summary.is_file()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if finished and not extend:
        if changes:
            raise ReproError(f"{paths.root}: the run finished at step {info.step}; it is not reopened to change "
                             f"{', '.join(changes)} (--extend continues it, with --set schedule.steps above "
                             f"{info.step})")
        print(f"{paths.root}: the run finished at step {info.step}; nothing to do", file=sys.stderr)
        return config, info, json.loads(paths.summary.read_text())
    if extend:
        if not finished:
            raise ReproError(f"{paths.root}: --extend reopens a finished run; this one is not finished "
                             "(--resume alone continues it)")
        if config.schedule.steps <= info.step:
            raise ReproError(f"{paths.root}: --extend needs --set schedule.steps above the {info.step} steps done")
        if rank0:
            for derived in (paths.summary, paths.root / "record.json"):
                derived.unlink(missing_ok=True)
    if info is None:
        print(f"{paths.root}: no complete checkpoint yet; training again from step 0", file=sys.stderr)
    if changes and rank0:
        for key, change in changes.items():
            print(f"{paths.root}: resumed with {key}: {change}", file=sys.stderr)
        # Kept in resume_changes.json (config.json holds the current settings).
        history_path = paths.root / "resume_changes.json"
        history = json.loads(history_path.read_text()) if history_path.is_file() else []
        write_json_atomic(history_path, [*history, {"from_step": info.step if info else 0, "changes": changes}])
    return config, info, None
