"""One engine for the suite's studies: a study is data (:class:`Study`: its runs, how they execute, where they
write, what it reports) and :func:`run_study` runs it. ``python -m repro study NAME [options]`` runs a
registered one, ``--list`` lists them; ``mini``, ``ablation`` and ``efficiency`` are studies with options of
their own (``python -m repro mini`` is the same as ``python -m repro study mini``). Adding a study:
docs/experiments.md, "Studies".

Execution: on CPU, every run in a fresh worker process (spawn, one thread) in ``workers`` lanes, the longest
first (by the CPU seconds the last ``summary.json`` in the output directory records); with a :class:`Launch`,
one ``python -m repro train`` per run, one after another, under torchrun where it spans more than one process.
A run directory holds the marker ``.<marker>-run`` of the study that created it, an output directory
``.<marker>-out``: a path without it is refused, never deleted. A run whose config and ``current`` check
match and which finished is reused; one that did not finish is resumed where the study allows it, else
replaced. Each invocation is appended to ``<work_dir>/sessions.json`` and each CPU run's cost (its worker's CPU
and wall seconds, summed over the invocations that trained it) is kept in its ``timing.json``.
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

from repro.errors import ReproError
from repro.io_utils import check_output_dir, claim_output_dir, claim_run_dir, open_in_dir, write_json_atomic
from repro.launch import Launch, torchrun_command


@dataclass(frozen=True)
class Run:
    """One run of a study.

    Args:
        run_id: its directory under the study's ``work_dir`` and its record's run id.
        experiment: the named experiment it starts from (``switch-tiny``).
        overrides: dot-list overrides applied to the experiment, in order.
        label: the row it belongs to where several seeds share one (a router, a cell); default the run id.
        wave: runs of a lower wave start first (a study cut short has whole seeds done).
        name: the config's name, where it is not the experiment's.
    """

    run_id: str
    experiment: str
    overrides: tuple[str, ...] = ()
    label: str = ""
    wave: int = 0
    name: str = ""

    def config(self):
        """The run's :class:`~repro.training.config.RunConfig` (ReproError on a bad experiment or override)."""
        from repro.training.config import apply_overrides
        from repro.training.experiments import get_experiment

        config = apply_overrides(get_experiment(self.experiment), list(self.overrides))
        return dataclasses.replace(config, name=self.name) if self.name else config


@dataclass(frozen=True)
class Study:
    """A study as data.

    Args:
        name: the study's name; its markers are ``.<name>-run`` and ``.<name>-out``.
        runs: the runs, in order.
        work_dir: the run directories' parent.
        out_dir: tables, plots and ``summary.json`` ("": none).
        task: trains one run, ``task(study, run)``, a module-level function: in a worker process on CPU
            (default :func:`train_and_record`); with ``launch``, in this process after the run's training.
        report: ``report(study, outcome)``: writes the outputs from the finished runs, returns the text to print.
        workers: CPU lanes.
        launch: train each run in its own ``python -m repro train`` (torchrun for more than one process).
        train_args: further arguments of that command (``--stop-after N``).
        resume: continue a run that did not finish (same config) instead of replacing it.
        finished: files a finished run holds.
        current: ``current(study, run)``: whether a finished run's other outputs match the current settings.
        settings: what the task and the report need besides the runs (an alias's frozen settings).
        owner: the study in words, for errors; command: the command line, for markers.
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
    command: str = ""

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
        """(owner, command) with their defaults."""
        command = self.command or f"python -m repro study {self.name}"
        return self.owner or command, command


# ------------------------------------------------------------------------------------------ run states
def run_state(study: Study, run: Run) -> str:
    """``done`` (finished and current), ``resume`` (this study's, same config, unfinished, resumable), ``new``
    (nothing there, or this study's run with other settings) or ``foreign`` (not this study's)."""
    from repro.training.config import RunConfig

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
    if all((run_dir / name).is_file() for name in study.finished) and (study.current is None or study.current(study, run)):
        return "done"
    return "resume" if study.resume else "new"


def longest_first(runs: Sequence[Run], cpu_seconds: Mapping[str, float]) -> list[Run]:
    """The runs of each wave (waves in order) longest first, by a previous run's CPU seconds (keyed by label).

    The pool starts runs in this order on its free workers, so the last to start is a short one and the
    workers finish close together. A run without a figure counts as the longest; ties keep the given order.
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
    """A CPU run's CPU and wall seconds over the invocations that trained it (None: not recorded)."""
    try:
        cost = json.loads((Path(run_dir) / "timing.json").read_text())
        return {key: float(cost[key]) for key in ("cpu_seconds", "wall_seconds")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------------------ CPU lanes
def train_and_record(study: Study, run: Run) -> None:
    """The default CPU task: train (or resume) the run, then write its record."""
    from repro.report.store import write_run_record
    from repro.training.trainer import train

    run_dir = study.run_dir(run)
    train(run.config(), run_dir, resume=(run_dir / "config.json").is_file(), progress=False)
    write_run_record(run_dir, warmup=2, run_id=run.run_id)


def _worker(study: Study, run: Run, log_path: Path) -> float:
    """One run in a fresh worker: one thread, offline (lm-eval bootstraps in-process), its output in
    ``log_path``; its cost added to the run's ``timing.json``. Returns the wall seconds."""
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
    usage = resource.getrusage(resource.RUSAGE_SELF)  # a fresh process: the run's whole cost, imports included
    before = run_cost(study.run_dir(run)) or {"cpu_seconds": 0.0, "wall_seconds": 0.0}
    write_json_atomic(study.run_dir(run) / "timing.json", {
        "cpu_seconds": before["cpu_seconds"] + usage.ru_utime + usage.ru_stime,
        "wall_seconds": before["wall_seconds"] + wall,
    })
    return wall


def _pool(study: Study, runs: list[Run]) -> tuple[dict[str, float], dict[str, str]]:
    """The runs in ``study.workers`` lanes, a fresh process each. Returns wall seconds and failures by run id."""
    from tqdm import tqdm

    seconds, failed = {}, {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(study.workers, mp_context=context, max_tasks_per_child=1) as pool, tqdm(
        total=len(runs), desc="runs", unit="run"
    ) as bar:
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
    program = ["-m", "repro", "train", "--experiment", run.experiment, "--out", str(study.run_dir(run))]
    for item in run.overrides:
        program += ["--set", item]
    program += [*study.train_args, *(["--resume"] if resume else [])]
    launch = study.launch
    if launch.nodes == 1 and launch.gpus_per_node == 1:
        return [sys.executable, *program]
    # Every node derives the same rendezvous id from the run directory; different runs get different ones.
    rdzv_id = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(study.run_dir(run))).strip("-")[-64:] or launch.rdzv_id
    launch = dataclasses.replace(launch, rdzv_id=rdzv_id) if launch.rdzv_id == "dirmoe-bench" else launch
    return torchrun_command(launch, program, launcher=(sys.executable, "-m", "torch.distributed.run"))


def _launched(study: Study, runs: list[Run], states: Mapping[str, str]) -> tuple[dict[str, float], dict[str, str]]:
    """The runs one after another, each in fresh processes; a failed run does not stop the others."""
    root = str(Path(__file__).resolve().parents[1])
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
    """Every run's state (:func:`run_state`; all ``new`` with ``fresh`` but a foreign one), and, unless
    ``check_only``, each run directory to train made this study's (emptied unless it resumes).

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
        raise ReproError(f"{foreign[0]}: exists and was not created by {owner}; move it away or choose another --work-dir{more}")
    states = dict.fromkeys(states, "new") if fresh else states
    for run in study.runs if not check_only else ():
        if states[run.run_id] != "done":
            claim_run_dir(study.run_dir(run), marker=study.markers[0], owner=owner, command=command,
                          keep=states[run.run_id] == "resume")
    return states


def execute(study: Study, *, fresh: bool = False) -> dict[str, Any]:
    """Train what is not done yet (every run with ``fresh``) and log the invocation.

    Returns:
        ``trained``, ``resumed``, ``reused`` (run ids), ``seconds`` (wall, per run trained) and ``failed``
        (run id -> what failed; on CPU the run's log).

    Raises:
        ReproError: a run directory this study did not create (nothing is touched), or, on CPU, failed runs.
    """
    Path(study.work_dir).mkdir(parents=True, exist_ok=True)
    states = claim(study, fresh=fresh)
    names = {s: [r.run_id for r in study.runs if states[r.run_id] == s] for s in ("new", "resume", "done")}
    if names["done"]:
        print(f"reusing finished runs: {', '.join(names['done'])}")
    if names["resume"]:
        print(f"resuming unfinished runs: {', '.join(names['resume'])}")
    todo = [r for r in study.runs if states[r.run_id] != "done"]
    where = "" if study.launch else f", {study.workers} at a time (logs in {study.work_dir}/<run>.worker.log)"
    print(f"training {len(todo)} runs{where}", flush=True)
    start, seconds, failed = time.perf_counter(), {}, {}
    try:
        if todo and study.launch:
            seconds, failed = _launched(study, todo, states)
        elif todo:
            seconds, failed = _pool(study, longest_first(todo, previous_cpu_seconds(study.out_dir)))
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
    try:
        history = json.loads(path.read_text()) if path.is_file() else []
    except ValueError:
        history = None
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
    """Check the output directory, ``prepare()`` (data), :func:`execute`, then claim the output directory and
    print ``study.report``'s text. Returns the outcome of :func:`execute` with ``elapsed`` (seconds) added."""
    check_out_dir(study)
    start = time.perf_counter()
    if prepare is not None:
        prepare()
    outcome = execute(study, fresh=fresh)
    outcome["elapsed"] = time.perf_counter() - start
    if study.out_dir:
        claim_output_dir(study.out_dir, study.markers[1], study.words[1])
    if study.report is not None:
        print(study.report(study, outcome))
    return outcome


# ------------------------------------------------------------------------------------------ command lines
def cpu_parser(prog: str, description: str, defaults: Any) -> argparse.ArgumentParser:
    """The options every CPU study shares, their defaults from ``defaults`` (a study's settings)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--steps", type=int, default=defaults.steps, help="training steps per run")
    p.add_argument("--workers", type=int, default=defaults.workers, help="runs trained at once")
    p.add_argument("--data-dir", default=defaults.data_dir)
    p.add_argument("--work-dir", default=defaults.work_dir)
    p.add_argument("--out", default=defaults.out_dir, help="tables, plots and summary.json")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every run")
    p.add_argument("--fresh", action="store_true", help="retrain every run even if it finished")
    return p


def pick(text: str, valid: Sequence[str], flag: str, what: str) -> tuple[str, ...]:
    """``all`` or a comma-separated list of names out of ``valid`` (ReproError naming the unknown ones)."""
    names = tuple(valid) if text.strip() == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise ReproError(f"{flag}: unknown {what}(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(valid)}")
    return names


# ------------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class Sweep:
    """A study given as a grid: each router's experiment at ``scale`` for each value of one setting.

    Args:
        name: ``python -m repro study NAME``.
        help: one line for ``--list``.
        key: the dot-list key swept (``model.top_k``; "": none, one run per router); values: its values.
        tag: run ids are ``<router>-<tag><value>`` (``<router>-<scale>`` without a key) under
            ``<--out>/<folder>`` (folder: default the name).
        routers: the routers run by default (``--router``).
        overrides: set on every run (before ``--set``).
        scale: the experiments' scale (``185m``, ``tiny``).
        gpus: default processes per run (0: CPU lanes).
        evaluate: zero-shot lm-eval on The Pile's seven tasks after each run.
    """

    name: str
    help: str
    key: str
    values: tuple[Any, ...]
    tag: str
    routers: tuple[str, ...] = ("dirmoe",)
    overrides: tuple[str, ...] = ("schedule.steps=10000",)
    scale: str = "185m"
    gpus: int = 8
    evaluate: bool = False
    folder: str = ""


#: Studies with options of their own: name -> (module whose ``main(argv, prog)`` runs it, help).
ALIASES: dict[str, tuple[str, str]] = {
    "mini": ("repro.mini", "the whole comparison on the embedded default (CPU)"),
    "ablation": ("repro.ablation", "why DirMoE's routing collapses: its readings and remedies over seeds (CPU)"),
    "efficiency": ("repro.efficiency", "iteration time and TFLOP/s of every router and dense on 1..N GPUs"),
}
SWEEPS: dict[str, Sweep] = {}


def register(sweep: Sweep) -> Sweep:
    """Make ``sweep`` runnable as ``python -m repro study NAME``. Returns it."""
    if sweep.name in SWEEPS or sweep.name in ALIASES:
        raise ValueError(f"a study named '{sweep.name}' exists already")
    SWEEPS[sweep.name] = sweep
    return sweep


for _sweep in (
    Sweep("pile-185m", "LLaMA-185M, E=8, k=1 on The Pile (60k steps), then zero-shot lm-eval", "", (None,), "",
          routers=("all",), overrides=(), evaluate=True, folder="."),
    Sweep("sweep-k", "active experts k in {1, 2, 4}, E=8, 10k steps", "model.top_k", (1, 2, 4), "k", ("dirmoe", "switch")),
    Sweep("sweep-E", "number of experts E in {8, 16, 32}, k=1, 10k steps", "model.num_experts", (8, 16, 32), "E",
          ("dirmoe", "switch")),
    Sweep("sweep-dirmoe-sparsity", "DirMoE's expected-k penalty in {0, 1e-3, 1e-2, 1e-1}, 10k steps",
          "router.options.sparsity_weight", (0.0, 0.001, 0.01, 0.1), "ls", folder="sweep-sparsity"),
    Sweep("sweep-dirmoe-m", "DirMoE's prior mass m in {0.7, ..., 0.95}, 10k steps", "router.options.prior_mass",
          (0.7, 0.8, 0.85, 0.9, 0.95), "m", folder="sweep-m"),
    Sweep("sweep-dirmoe-recon", "DirMoE's reconstruction target, raw (the paper) or centered, 10k steps",
          "router.options.recon_target", ("raw", "centered"), "", folder="sweep-recon"),
):
    register(_sweep)


PILE_TASKS = "arc_challenge,arc_easy,boolq,hellaswag,lambada_openai,piqa,race"


def _evaluate(study: Study, run: Run) -> None:
    """After a run of a sweep that evaluates: zero-shot lm-eval on The Pile's tasks, in a process of its own."""
    out = str(study.run_dir(run))
    cmd = ["-m", "repro", "eval", "--checkpoint", out, "--tasks", PILE_TASKS, "--out", f"{out}/lm_eval.json"]
    cmd += ["--tasks-data", study.settings] if study.settings else []
    if study.launch.nodes > 1:  # one process on one GPU: not on every node at once
        print(f"evaluate once the run is done, on one node: python {' '.join(cmd)}")
    elif subprocess.run([sys.executable, *cmd], check=False).returncode != 0:
        raise ReproError("python -m repro eval failed (its output is above)")


def sweep_study(sweep: Sweep, args: argparse.Namespace) -> Study:
    """The :class:`Study` of ``sweep`` with the command line's options."""
    from repro.training.config import MEGATRON_ROUTER
    from repro.training.experiments import experiment_routers

    routers = args.router.split(",") if args.router else list(sweep.routers)
    if routers == ["all"]:
        routers = [r for r in experiment_routers() if r != MEGATRON_ROUTER]
    values = [v for v in sweep.values if not args.values or str(v) in args.values.split(",")]
    if not values:
        raise ReproError(f"--values: none of {args.values} is a value of {sweep.name}: {', '.join(map(str, sweep.values))}")
    data = [f"data.source=pile:{args.data}"] if args.data else []
    data += [f"data.tokenizer={args.tokenizer}"] if args.tokenizer else []
    runs = []
    for value in values:
        for router in routers:
            text = format(value, "g") if isinstance(value, float) else str(value)
            run_id = f"{router}-{sweep.tag}{text}" if sweep.key else f"{router}-{sweep.scale}"
            sets = [*data, *([f"{sweep.key}={value}"] if sweep.key else []), *sweep.overrides, *args.set]
            runs.append(Run(run_id, f"{router}-{sweep.scale}", tuple(sets)))
    gpus = sweep.gpus if args.gpus is None else args.gpus
    try:
        launch = Launch(args.nodes, gpus, args.rdzv_endpoint, args.rdzv_id or "dirmoe-bench") if gpus else None
    except ValueError as exc:
        raise ReproError(str(exc)) from None
    return Study(sweep.name, tuple(runs), str(Path(args.out) / (sweep.folder or sweep.name)), workers=args.workers,
                 launch=launch, resume=True, task=_evaluate if sweep.evaluate else None, settings=args.tasks_data)


def main(argv: list[str], prog: str = "python -m repro study") -> int:
    """Run the study ``argv[0]`` (``--list``: list them). Returns the exit status."""
    every = [*ALIASES, *SWEEPS]
    if not argv or argv[0] in ("--list", "-h", "--help"):
        width = max(map(len, every))
        print(f"usage: {prog} NAME [options]  ({prog} NAME --help: its options)\n\nstudies:")
        print("\n".join(f"  {n:<{width}}  {ALIASES[n][1] if n in ALIASES else SWEEPS[n].help}" for n in every))
        return 0
    name, rest = argv[0], argv[1:]
    if name in ALIASES:
        import importlib

        return int(importlib.import_module(ALIASES[name][0]).main(rest, prog=f"{prog} {name}") or 0)
    if name not in SWEEPS:
        raise ReproError(f"unknown study '{name}'; valid: {', '.join(every)}")
    sweep = SWEEPS[name]
    p = argparse.ArgumentParser(prog=f"{prog} {name}", description=sweep.help)
    p.add_argument("--router", default="", help=f"comma-separated routers, or all (default {','.join(sweep.routers)})")
    p.add_argument("--values", default="", help=f"comma-separated values of {sweep.key or 'the sweep'} (default all)")
    p.add_argument("--data", default="", required=sweep.scale != "tiny",
                   help="indexed-dataset prefix(es) of tokenized Pile shards, comma-separated")
    p.add_argument("--tokenizer", default="", help="directory with GPT-2 vocab.json and merges.txt (default: beside the data)")
    p.add_argument("--gpus", type=int, default=None, help=f"processes per node per run (0: CPU lanes; default {sweep.gpus})")
    p.add_argument("--workers", type=int, default=2, help="CPU lanes (with --gpus 0)")
    p.add_argument("--out", default="runs/pile", help="root of the run directories")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    p.add_argument("--nodes", type=int, default=1, help="nodes; run the same command on each (shared filesystem)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="c10d rendezvous endpoint (--nodes > 1)")
    p.add_argument("--rdzv-id", default=None, help="rendezvous id, the same on every node (default: from the run directory)")
    p.add_argument("--tasks-data", default=None, metavar="DIR", help="the zero-shot tasks' datasets on disk (eval-data fetch)")
    p.add_argument("--fresh", action="store_true", help="retrain every run even if it finished")
    args = p.parse_args(rest)
    study = sweep_study(sweep, args)
    for run in study.runs:
        run.config()  # unknown keys / bad values: one-line error before any work
    return 1 if run_study(study, fresh=args.fresh)["failed"] else 0
