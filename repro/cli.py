"""``python -m repro <command> ...``: one entry point, each command in its own module.

Commands are imported only when chosen, so ``python -m repro tables`` does not import megatron-core.
Each command module exposes ``main(argv: list[str], prog: str) -> int``. A :class:`ReproError`
(bad input) is printed as one line, ``error: ...``, with exit status 2.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from repro.errors import ReproError, unknown_name

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("repro.training.cli", "main", "train one experiment on megatron-core"),
    "data": ("repro.data.cli", "main", "build the mini-pile / tokenize Pile shards into indexed datasets"),
    "eval": ("repro.evaluation.cli", "main", "zero-shot evaluation of a checkpoint through lm-eval"),
    "eval-data": ("repro.evaluation.data_cli", "main", "fetch (online) or check the datasets of lm-eval's tasks for eval --tasks-data"),
    "tables": ("repro.report.cli", "tables_main", "build the zero-shot and efficiency tables from run records"),
    "check": ("repro.report.cli", "check_main", "regression-check a run against published numbers or a run"),
    "writeup": ("repro.report.writeup", "main", "write results/<study>/README.md and the README's result blocks from the results files"),
    "study": ("repro.studies", "main", "run a study by name (--list: mini, ablation, efficiency, the sweeps)"),
    "mini": ("repro.mini", "main", "the whole comparison on the embedded default (CPU)"),
    "ablation": ("repro.ablation", "main", "why DirMoE's routing collapses: its readings and remedies over seeds (CPU)"),
    "bench-table": ("repro.report.bench_table", "main", "summarise a pytest-benchmark JSON as a table"),
    "golden": ("repro.golden", "main", "compare fresh runs with the golden loss curves (or --refresh them)"),
    "launch": ("repro.launch", "main", "print the torchrun command or SLURM script for N nodes x G GPUs"),
    "efficiency": ("repro.efficiency", "main", "iteration time and TFLOP/s of every router and dense on 1..N GPUs"),
}


def comma_list(text: str) -> list[str]:
    """An argparse type: ``"a, b,,c"`` -> ``["a", "b", "c"]`` (for task, format and router lists)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _program() -> str:
    """How the user called us: ``dirmoe-bench`` (the console script ``pip install`` puts on the PATH) or
    ``python -m repro``."""
    return "dirmoe-bench" if Path(sys.argv[0]).name == "dirmoe-bench" else "python -m repro"


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {_program()} <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command. Returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: {unknown_name('command', name, list(COMMANDS))}", file=sys.stderr)
        return 2
    module_name, func_name, _ = COMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(rest, prog=f"{_program()} {name}") or 0)
    except ReproError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
