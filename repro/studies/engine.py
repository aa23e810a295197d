"""One engine for the suite's studies: a study is data (:class:`Study`: its runs, how they execute, where they
write, what it reports) and :func:`run_study` runs it; :mod:`repro.studies.registry` holds the registered ones and
``python -m repro study NAME``. How studies execute, reuse and resume runs, and adding one: docs/experiments.md,
"Studies".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repro.errors import ReproError, unknown_name
from repro.io_utils import check_output_dir, claim_output_dir, claim_run_dir, open_in_dir, read_json, write_json_atomic
from repro.launch import Launch, torchrun_command
from repro.schema import check_minimums


def usable_cores() -> int:
    """CPU cores this process may use (its affinity set, not the machine's count): a CPU study's default lanes."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True, kw_only=True)
class CpuStudySettings:
    """Settings shared by CPU studies (base of :class:`~repro.studies.mini.MiniConfig`,
    :class:`~repro.studies.ablation.AblationConfig`); command line: :meth:`parser`.

    Args:
        steps: training steps per run.
        data_dir: where the mini-pile is built (or found).
        work_dir: run directories (checkpoints, logs, records).
        out_dir: tables, plots and ``summary.json``.
        workers: runs trained at once, one single-threaded process each (default: :func:`usable_cores`).
        overrides: extra dot-list overrides for every run.
    """

    steps: int = 600
    data_dir: str = "data/mini-pile"
    work_dir: str
    out_dir: str
    workers: int = dataclasses.field(default_factory=usable_cores)
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_minimums(self, steps=1, workers=1)

    def run_overrides(self) -> tuple[str, str]:
        """Overrides putting a run on this study's data and steps (before the study's own)."""
        return f"schedule.steps={self.steps}", f"data.source=mini-pile:{self.data_dir}"

    def run_dir(self, *job: Any) -> Path:
        """The directory of one of the subclass's ``jobs()``, named by its ``run_id(*job)``."""
        return Path(self.work_dir) / self.run_id(*job)

    def experiment(self, *job: Any):
        """The config of one of the subclass's ``jobs()``: its ``run(*job)``'s."""
        return self.run(*job).config()

    def parser(self, prog: str, description: str) -> argparse.ArgumentParser:
        """The shared options, defaulting to these settings (:meth:`shared`)."""
        p = argparse.ArgumentParser(prog=prog, description=description)
        p.add_argument("--steps", type=int, default=self.steps, help="training steps per run")
        p.add_argument("--workers", type=int, default=self.workers,
                       help=f"runs trained at once, one thread each (default {self.workers}: the usable cores)")
        p.add_argument("--data-dir", default=self.data_dir)
        p.add_argument("--work-dir", default=self.work_dir)
        p.add_argument("--out", default=self.out_dir, help="tables, plots and summary.json")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every run")
        p.add_argument("--fresh", action="store_true", help="retrain every run even if it finished")
        return p

    @staticmethod
    def shared(args: argparse.Namespace) -> dict[str, Any]:
        """The shared fields from :meth:`parser`'s arguments, as keyword arguments."""
        return dict(steps=args.steps, data_dir=args.data_dir, work_dir=args.work_dir, out_dir=args.out,
                    workers=args.workers, overrides=tuple(args.set))


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors as one :class:`ReproError` line, as every command's bad argument."""

    def error(self, message: str):  # type: ignore[override]
        raise ReproError(message)


def check_flags(args: argparse.Namespace, **minimums: int) -> None:
    """ReproError naming the first option below its minimum (an unset None passes)."""
    for name, low in minimums.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise ReproError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def pick(text: str, valid: Sequence[str], flag: str, what: str) -> tuple[str, ...]:
    """``all`` or a comma-separated list of names out of ``valid`` (ReproError naming the unknown ones)."""
    names = tuple(valid) if text.strip() == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in valid]
    if len(unknown) == 1:
        raise ReproError(f"{flag}: {unknown_name(what, unknown[0], valid)}")
    if unknown or not names:
        raise ReproError(f"{flag}: unknown {what}(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(valid)}")
    return names


@dataclass(frozen=True)
class Run:
    """One run of a study.

    Args:
        run_id: directory under ``work_dir`` and record run id.
        experiment: the named experiment (``switch-tiny``).
        overrides: dot-list overrides, in order.
        label: the row it belongs to when seeds share one (a router, a cell); default the run id.
        wave: lower waves start first (a study cut short has whole seeds done).
        name: the config's name, if not the experiment's.
    """

    run_id: str
    experiment: str
    overrides: tuple[str, ...] = ()
    label: str = ""
    wave: int = 0
    name: str = ""

    def config(self):
        """The run's :class:`~repro.config.RunConfig` (ReproError on a bad experiment or override), cached so
        checks, worker (pickled with the run) and trainer share one object."""
        config = self.__dict__.get("_config")
        if config is None:
            from repro.config import apply_overrides
            from repro.experiments import get_experiment

            config = apply_overrides(get_experiment(self.experiment), list(self.overrides))
            config = dataclasses.replace(config, name=self.name) if self.name else config
            object.__setattr__(self, "_config", config)  # frozen: a cache, not a field (eq and hash ignore it)
        return config


@dataclass(frozen=True)
class Study:
    """A study as data.

    Args:
        name: markers are ``.<name>-run`` and ``.<name>-out``.
        runs: in order.
        work_dir: the run directories' parent.
        out_dir: tables, plots and ``summary.json`` ("": none).
        task: module-level ``task(study, run)``: trains a run in a CPU worker (default :func:`train_and_record`);
            with ``launch``, runs in this process after the run's training.
        report: ``report(study, outcome)``: writes outputs from finished runs, returns the text to print.
        workers: CPU lanes.
        launch: train each run in its own ``python -m repro train`` (torchrun for several processes).
        train_args: further arguments of that command (``--stop-after N``).
        resume: continue an unfinished run (same config) instead of replacing it.
        finished: files a finished run holds.
        current: ``current(study, run)``: whether a finished run's other outputs match the settings.
        settings: what task and report need besides the runs.
        owner: the study in words, for errors (default: its command line, ``python -m repro study NAME``).
    """

    name: str
    runs: tuple[Run, ...]
    work_dir: str
    out_dir: str = ""
    task: Callable[[Study, Run], Any] | None = None
    report: Callable[[Study, dict], str] | None = None
    workers: int = 2
    launch: Launch | None = None
    train_args: tuple[str, ...] = ()
    resume: bool = False
    finished: tuple[str, ...] = ("record.json",)
    current: Callable[[Study, Run], bool] | None = None
    settings: Any = None
    owner: str = ""

    def run_dir(self, run: Run) -> Path:
        return Path(self.work_dir) / run.run_id

    @property
    def markers(self) -> tuple[str, str]:
        """The run directories' and the output directory's marker files."""
        return f".{self.name}-run", f".{self.name}-out"

    @property
    def shared(self) -> bool:
        """Several nodes run this study at once (on one filesystem)."""
        return self.launch is not None and self.launch.nodes > 1

    @property
    def words(self) -> tuple[str, str]:
        """(owner, command line): the command line also goes in the markers."""
        command = f"python -m repro study {self.name}"
        return self.owner or command, command


# ------------------------------------------------------------------------------------------ run states
def run_state(study: Study, run: Run) -> str:
    """``done`` (finished, current), ``resume`` (ours, same config, unfinished), ``new`` (nothing there, or ours
    with other settings) or ``foreign`` (not ours)."""
    from repro.config import RunConfig

    run_dir = study.run_dir(run)
    if not run_dir.exists() and not run_dir.is_symlink():
        return "new"
    if run_dir.is_symlink() or not (run_dir / study.markers[0]).is_file():
        return "foreign"
    try:
        stored = RunConfig.stored_dict(json.loads((run_dir / "config.json").read_text())["experiment"])
    except (OSError, ValueError, KeyError, TypeError):
        return "new"
    if stored != run.config().to_dict():
        # A launched run that resumes is never replaced: ``train --resume`` refuses a config it cannot continue.
        return "resume" if study.launch is not None and study.resume else "new"
    finished = all((run_dir / name).is_file() for name in study.finished)
    if finished and (study.current is None or study.current(study, run)):
        return "done"
    return "resume" if study.resume else "new"


def longest_first(runs: Sequence[Run], cpu_seconds: Mapping[str, float]) -> list[Run]:
    """Runs of each wave (in wave order) longest first by previous CPU seconds (by label), so workers finish
    close together. A run without a figure counts as longest; ties keep the given order.
    """
    return sorted(runs, key=lambda run: (run.wave, -cpu_seconds.get(run.label or run.run_id, math.inf)))


def previous_cpu_seconds(out_dir: str) -> dict[str, float]:
    """run id -> its CPU seconds in the last ``summary.json`` of ``out_dir`` (``run_cpu_seconds``), or nothing."""
    try:
        seconds = json.loads((Path(out_dir) / "summary.json").read_text())["run_cpu_seconds"]
        return {str(run): float(value) for run, value in seconds.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def run_cost(run_dir: Path) -> dict[str, float] | None:
    """A CPU run's CPU and wall seconds over all its invocations (None: not recorded)."""
    keys, run_dir = ("cpu_seconds", "wall_seconds"), Path(run_dir)
    try:
        if not (run_dir / "timing.json").exists():  # an ablation run trained before timing.json: its invocations
            history = json.loads((run_dir / "ablation_cost.json").read_text())
            return {key: round(sum(float(h[key]) for h in history), 1) for key in keys}
        cost = json.loads((run_dir / "timing.json").read_text())
        return {key: float(cost[key]) for key in keys}
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------------------ CPU lanes
def train_and_record(study: Study, run: Run) -> None:
    """The default CPU task: train (or resume) the run, then write its record."""
    from repro.records.store import write_run_record
    from repro.training.trainer import train

    run_dir = study.run_dir(run)
    train(run.config(), run_dir, resume=(run_dir / "config.json").is_file(), progress=False)
    write_run_record(run_dir, warmup=2, run_id=run.run_id)


def _worker(study: Study, run: Run, log_path: Path) -> float:
    """One run in a fresh single-threaded offline worker, logging to ``log_path``. Returns the wall seconds."""
    import resource

    import torch

    from repro.evaluation.offline import ensure_offline

    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DISABLE_MULTIPROC="1")
    ensure_offline()
    torch.set_num_threads(1)
    start = time.perf_counter()
    with open_in_dir(log_path.parent, log_path.name, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            (study.task or train_and_record)(study, run)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            raise
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)  # this process since its fork: the run, not the preloaded imports
    before = run_cost(study.run_dir(run)) or {"cpu_seconds": 0.0, "wall_seconds": 0.0}
    write_json_atomic(study.run_dir(run) / "timing.json", {
        "cpu_seconds": before["cpu_seconds"] + usage.ru_utime + usage.ru_stime,
        "wall_seconds": before["wall_seconds"] + wall,
    })
    return wall


def _pool(study: Study, runs: list[Run]) -> tuple[dict[str, float], dict[str, str]]:
    """The runs in ``study.workers`` lanes, a process each. Returns wall seconds and failures by run id."""
    from tqdm import tqdm

    seconds, failed = {}, {}
    context = multiprocessing.get_context("forkserver")
    # The fork server imports the rest once, when it starts: once per command.
    context.set_forkserver_preload(["repro.studies.worker_preload"])
    with (ProcessPoolExecutor(study.workers, mp_context=context, max_tasks_per_child=1) as pool,
          tqdm(total=len(runs), desc="runs", unit="run") as bar):
        log_dir = Path(study.work_dir)
        futures = {pool.submit(_worker, study, run, log_dir / f"{run.run_id}.worker.log"): run.run_id for run in runs}
        for future in as_completed(futures):
            name = futures[future]
            bar.update(1)
            try:
                seconds[name] = future.result()
                bar.write(f"  {name}: done in {seconds[name]:.0f} s")
            except Exception as exc:  # noqa: BLE001 - reported per run, with its log
                bar.write(f"  {name}: FAILED ({type(exc).__name__}: {exc})")
                failed[name] = str(log_dir / f"{name}.worker.log")
    return seconds, failed


# ------------------------------------------------------------------------------------------ launched runs
def train_command(study: Study, run: Run, resume: bool = False) -> list[str]:
    """``python -m repro train`` for ``run`` (under torchrun where the launch spans more than one process)."""
    program = ["-m", "repro", "train", "--experiment", run.experiment, "--out", str(study.run_dir(run)),
               *(arg for item in run.overrides for arg in ("--set", item)), *study.train_args,
               *(["--resume"] if resume else [])]
    launch = study.launch
    if launch.nodes == 1 and launch.gpus_per_node == 1:
        return [sys.executable, *program]
    # Every node derives the same rendezvous id from the run directory; different runs get different ones.
    rdzv_id = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(study.run_dir(run))).strip("-")[-64:] or launch.rdzv_id
    launch = dataclasses.replace(launch, rdzv_id=rdzv_id) if launch.rdzv_id == "dirmoe-bench" else launch
    return torchrun_command(launch, program, launcher=(sys.executable, "-m", "torch.distributed.run"))


def _launched(study: Study, runs: list[Run], states: Mapping[str, str]) -> tuple[dict[str, float], dict[str, str]]:
    """The runs one after another, each in fresh processes; a failed run does not stop the others."""
    root = str(Path(__file__).resolve().parents[2])  # the checkout holding ``repro``, whatever the working directory
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    seconds, failed = {}, {}
    for run in runs:
        start = time.perf_counter()
        try:
            proc = subprocess.run(train_command(study, run, states[run.run_id] == "resume"), env=env, check=False)
            if proc.returncode != 0:
                raise ReproError(f"training exited with status {proc.returncode} (its output is above)")
            if study.task is not None:
                study.task(study, run)
        except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
            if not isinstance(exc, ReproError):
                traceback.print_exc()
            failed[run.run_id] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        seconds[run.run_id] = time.perf_counter() - start
        state = f"FAILED ({failed[run.run_id]})" if run.run_id in failed else "done"
        print(f"  {run.run_id}: {state} in {seconds[run.run_id]:.0f} s", flush=True)
    return seconds, failed


# ------------------------------------------------------------------------------------------ the engine
def claim(study: Study, *, fresh: bool = False, check_only: bool = False) -> dict[str, str]:
    """Every run's state (:func:`run_state`; ``new`` with ``fresh``, foreign ones aside); unless ``check_only``,
    claim the output directory and each run directory to train (emptied unless it resumes).

    Raises:
        ReproError: a run directory this study did not create, before any is touched.
    """
    owner, command = study.words
    if study.shared:  # several nodes, one filesystem: only the trainer's own checks hold
        return {r.run_id: "resume" if (study.run_dir(r) / "config.json").is_file() else "new" for r in study.runs}
    states = {run.run_id: run_state(study, run) for run in study.runs}
    foreign = [str(study.run_dir(r)) for r in study.runs if states[r.run_id] == "foreign"]
    if foreign:
        more = f" ({len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise ReproError(
            f"{foreign[0]}: exists and was not created by {owner}; move it away or choose another --work-dir{more}")
    states = dict.fromkeys(states, "new") if fresh else states
    if check_only:
        return states
    if study.out_dir:  # before the run directories: the work directory may lie inside it
        claim_output_dir(study.out_dir, study.markers[1], command)
    Path(study.work_dir).mkdir(parents=True, exist_ok=True)
    for run in study.runs:
        if states[run.run_id] != "done":
            claim_run_dir(study.run_dir(run), marker=study.markers[0], owner=owner, command=command,
                          keep=states[run.run_id] == "resume")
    return states


def execute(study: Study, *, fresh: bool = False) -> dict[str, Any]:
    """Train what is not done yet (every run with ``fresh``) and log the invocation.

    Returns:
        ``trained``, ``resumed``, ``reused`` (run ids), ``seconds`` (wall, per run trained), ``failed``
        (run id -> what failed; on CPU the run's log).

    Raises:
        ReproError: a run directory this study did not create (nothing touched), or failed CPU runs.
    """
    states = claim(study, fresh=fresh)
    names = {s: [r.run_id for r in study.runs if states[r.run_id] == s] for s in ("new", "resume", "done")}
    for state, what in (("done", "reusing finished runs"), ("resume", "resuming unfinished runs")):
        if names[state]:
            print(f"{what}: {', '.join(names[state])}")
    todo = [r for r in study.runs if states[r.run_id] != "done"]
    where = "" if study.launch else f", {study.workers} at a time (logs in {study.work_dir}/<run>.worker.log)"
    print(f"training {len(todo)} runs{where}", flush=True)
    start, seconds, failed = time.perf_counter(), {}, {}
    try:
        if todo and study.launch:
            seconds, failed = _launched(study, todo, states)
        elif todo:
            previous = previous_cpu_seconds(study.out_dir) if study.out_dir else {}
            seconds, failed = _pool(study, longest_first(todo, previous))
    finally:
        if not study.shared:
            _note_session(study, time.perf_counter() - start, names, seconds)
    if failed and not study.launch:
        raise ReproError(f"run(s) {', '.join(failed)} failed; see {', '.join(failed.values())}")
    return {"trained": names["new"], "resumed": names["resume"], "reused": names["done"], "seconds": seconds,
            "failed": failed}


def _note_session(study: Study, wall: float, names: dict[str, list[str]], seconds: dict[str, float]) -> None:
    """Append this invocation to ``<work_dir>/sessions.json`` (a damaged log is left alone)."""
    path = Path(study.work_dir) / "sessions.json"
    history = read_json(path) if path.is_file() else []
    if not isinstance(history, list):
        print(f"{path}: not a JSON list; this invocation is not logged there")
        return
    history.append({
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_seconds": round(wall, 1), "workers": study.workers,
        "trained": names["new"], "resumed": names["resume"], "reused": len(names["done"]),
        "run_seconds": {name: round(s, 1) for name, s in sorted(seconds.items())},
    })
    write_json_atomic(path, history)


def check_out_dir(study: Study) -> None:
    """Refuse, before any work, an output directory of another command."""
    if study.out_dir:
        check_output_dir(study.out_dir, study.markers[1], study.words[1])


def run_study(study: Study, *, fresh: bool = False, prepare: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Build every run's config, check the output directory, ``prepare()`` (data), :func:`execute`, then print
    ``study.report``'s text.

    Returns:
        The outcome of :func:`execute` with ``elapsed`` (seconds) added.
    """
    for run in study.runs:
        run.config()  # unknown keys / bad values: one-line error before any work
    check_out_dir(study)
    start = time.perf_counter()
    if prepare is not None:
        prepare()
    outcome = execute(study, fresh=fresh)
    outcome["elapsed"] = time.perf_counter() - start
    if study.report is not None:
        print(study.report(study, outcome))
    return outcome
