"""The registered studies and ``python -m repro study NAME [options]`` (``--list``): ``mini``, ``ablation``,
``efficiency`` and ``router-costs`` (studies with options of their own: a module whose ``main(argv, prog)`` runs
it) and the grids of full-scale runs (:class:`Sweep`: ``pile-185m`` and the sweeps), which the engine
(:mod:`repro.studies.engine`) runs. A user's grid is one :func:`register` call, a user's study with its own runs,
tables and write-up one :func:`register_study` call or entry point (docs/experiments.md, "Studies").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repro.errors import ReproError, unknown_name
from repro.launch import Launch
from repro.studies.engine import Run, Study, run_study


@dataclass(frozen=True)
class Sweep:
    """A study given as a grid: each router's experiment of ``flavour`` for each value of one setting.

    Args:
        name: ``python -m repro study NAME``.
        help: one line for ``--list``.
        key: the dot-list key swept (``model.top_k``; "": one run per router); values: its values.
        tag: run ids are ``<router>-<tag><value>`` (``<router>-<flavour>`` without a key) under
            ``<--out>/<folder>`` (default folder: the name).
        routers: default routers (``--router``).
        overrides: set on every run (before ``--set``).
        flavour: the experiments' model flavour (``185m``, ``tiny``).
        gpus: default processes per run (0: CPU lanes).
        evaluate: zero-shot lm-eval on the seven tasks after each run.
    """

    name: str
    help: str
    key: str
    values: tuple[Any, ...]
    tag: str
    routers: tuple[str, ...] = ("dirmoe",)
    overrides: tuple[str, ...] = ("schedule.steps=10000",)
    flavour: str = "185m"
    gpus: int = 8
    evaluate: bool = False
    folder: str = ""


#: Studies with options of their own: name -> (module whose ``main(argv, prog)`` runs it, help).
ALIASES = {
    "mini": ("repro.studies.mini", "the whole comparison on the embedded default (CPU)"),
    "ablation": ("repro.studies.ablation", "why DirMoE's routing collapses: its readings and remedies over seeds (CPU)"),
    "efficiency": ("repro.studies.efficiency", "iteration time and TFLOP/s of every router and dense on 1..N GPUs"),
    "router-costs": ("repro.studies.router_costs", "kernel launches and host syncs per router call, counted on any machine"),
}
SWEEPS: dict[str, Sweep] = {}


#: Entry-point group for other packages' studies: ``NAME = "package.module"`` with ``main(argv, prog)``.
ENTRY_POINT_GROUP = "dirmoe_bench.studies"


def register(sweep: Sweep) -> Sweep:
    """Make ``sweep`` runnable as ``python -m repro study NAME``. Returns it."""
    if sweep.name in SWEEPS or sweep.name in ALIASES:
        raise ValueError(f"a study named '{sweep.name}' exists already")
    SWEEPS[sweep.name] = sweep
    return sweep


def register_study(name: str, module: str, help_: str) -> None:
    """Make ``module``'s ``main(argv, prog)`` runnable as ``python -m repro study NAME`` (external studies)."""
    if name in SWEEPS or name in ALIASES:
        raise ValueError(f"a study named '{name}' exists already")
    ALIASES[name] = (module, help_)


def writeups() -> dict[str, Callable[[Path], Any]]:
    """Results directory name -> its study's write-up function, from each study module's ``WRITEUPS =
    {"<directory>": "module:function"}`` (imported only here)."""
    import importlib

    _plugins()
    found: dict[str, Callable[[Path], Any]] = {}
    for study, (module, _) in ALIASES.items():
        for directory, target in getattr(importlib.import_module(module), "WRITEUPS", {}).items():
            name, _, function = target.partition(":")
            try:
                make = getattr(importlib.import_module(name), function)
            except (ImportError, AttributeError) as exc:
                raise ReproError(f"study '{study}': its write-up of results/{directory}, '{target}', cannot be "
                                 f"loaded ({exc})") from None
            if directory in found:
                raise ReproError(f"results/{directory} has two write-ups; the second is study '{study}''s '{target}'")
            found[directory] = make
    return found


def _plugins() -> None:
    """Register the studies other packages declare through :data:`ENTRY_POINT_GROUP` (once)."""
    from importlib import metadata

    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name not in ALIASES and entry.name not in SWEEPS:
            register_study(entry.name, entry.value, f"(from {entry.value})")


for _sweep in (
    Sweep("pile-185m", "LLaMA-185M, E=8, k=1 on The Pile (60k steps), then zero-shot lm-eval", "", (None,), "",
          routers=("all",), overrides=(), evaluate=True, folder="."),
    Sweep("sweep-k", "active experts k in {1, 2, 4}, E=8, 10k steps", "model.top_k", (1, 2, 4), "k",
          ("dirmoe", "switch")),
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
    """After a sweep's run: zero-shot lm-eval in a process of its own."""
    out = str(study.run_dir(run))
    cmd = ["-m", "repro", "eval", "--checkpoint", out, "--tasks", PILE_TASKS, "--out", f"{out}/lm_eval.json"]
    cmd += ["--tasks-data", study.settings] if study.settings else []
    if study.launch.nodes > 1:  # one process on one GPU: not on every node at once
        print(f"evaluate once the run is done, on one node: python {' '.join(cmd)}")
    elif subprocess.run([sys.executable, *cmd], check=False).returncode != 0:
        raise ReproError("python -m repro eval failed (its output is above)")


def sweep_study(sweep: Sweep, args: argparse.Namespace) -> Study:
    """The :class:`Study` of ``sweep`` with the command line's options."""
    from repro.config import MEGATRON_ROUTER
    from repro.experiments import experiment_routers

    routers = args.router.split(",") if args.router else list(sweep.routers)
    if routers == ["all"]:
        routers = [r for r in experiment_routers() if r != MEGATRON_ROUTER]
    values = [v for v in sweep.values if not args.values or str(v) in args.values.split(",")]
    if not values:
        valid = ", ".join(map(str, sweep.values))
        raise ReproError(f"--values: none of {args.values} is a value of {sweep.name}: {valid}")
    data = [f"data.source=pile:{args.data}"] if args.data else []
    data += [f"data.tokenizer={args.tokenizer}"] if args.tokenizer else []
    runs = [Run(f"{router}-{sweep.tag}{text}" if sweep.key else f"{router}-{sweep.flavour}",
                f"{router}-{sweep.flavour}",
                (*data, *([f"{sweep.key}={value}"] if sweep.key else []), *sweep.overrides, *args.set))
            for value in values for text in [format(value, "g") if isinstance(value, float) else str(value)]
            for router in routers]
    gpus = sweep.gpus if args.gpus is None else args.gpus
    try:
        launch = Launch(args.nodes, gpus, args.rdzv_endpoint, args.rdzv_id or "dirmoe-bench") if gpus else None
    except ValueError as exc:
        raise ReproError(str(exc)) from None
    return Study(sweep.name, tuple(runs), str(Path(args.out) / (sweep.folder or sweep.name)), workers=args.workers,
                 launch=launch, resume=True, task=_evaluate if sweep.evaluate else None, settings=args.tasks_data)


def main(argv: list[str], prog: str = "python -m repro study") -> int:
    """Run the study ``argv[0]`` (``--list``: list them). Returns the exit status."""
    _plugins()
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
        raise ReproError(unknown_name("study", name, every))
    sweep = SWEEPS[name]
    p = argparse.ArgumentParser(prog=f"{prog} {name}", description=sweep.help)
    p.add_argument("--router", default="", help=f"comma-separated routers, or all (default {','.join(sweep.routers)})")
    p.add_argument("--values", default="", help=f"comma-separated values of {sweep.key or 'the sweep'} (default all)")
    p.add_argument("--data", default="", required=sweep.flavour != "tiny",
                   help="indexed-dataset prefix(es) of tokenized Pile shards, comma-separated")
    p.add_argument("--tokenizer", default="", help="directory with GPT-2 vocab.json and merges.txt (default: beside the data)")
    p.add_argument("--gpus", type=int, default=None, help=f"processes per node per run (0: CPU lanes; default {sweep.gpus})")
    p.add_argument("--workers", type=int, default=2, help="CPU lanes (with --gpus 0)")
    p.add_argument("--out", default="runs/pile", help="root of the run directories")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    p.add_argument("--nodes", type=int, default=1, help="nodes; run the same command on each (shared filesystem)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="c10d rendezvous endpoint (--nodes > 1)")
    p.add_argument("--rdzv-id", default=None, help="rendezvous id, the same on every node (default: from the run directory)")
    p.add_argument("--tasks-data", default=None, metavar="DIR", help="the zero-shot tasks' datasets on disk (eval fetch)")
    p.add_argument("--fresh", action="store_true", help="retrain every run even if it finished")
    args = p.parse_args(rest)
    return 1 if run_study(sweep_study(sweep, args), fresh=args.fresh)["failed"] else 0
