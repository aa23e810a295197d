"""``python -m repro <command> [<subcommand>] ...``: seven commands, each in its own module.

Commands are imported only when chosen, so ``python -m repro report tables`` does not import megatron-core.
Each command module exposes a function ``(argv: list[str], prog: str) -> int``. A :class:`ReproError`
(bad input) is printed as one line, ``error: ...``, with exit status 2.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from repro.errors import ReproError, unknown_name

#: ``module:function`` and one line of help
Entry = tuple[str, str]

#: name -> an entry, or for a command with subcommands, subcommand -> entry
COMMANDS: dict[str, Entry | dict[str, Entry]] = {
    "train": ("repro.training.cli:main", "train one experiment on megatron-core"),
    "data": ("repro.data.cli:main", "build the mini-pile / tokenize Pile shards into indexed datasets"),
    "eval": {
        "run": ("repro.evaluation.cli:main", "zero-shot evaluation of a checkpoint through lm-eval"),
        "fetch": ("repro.evaluation.data_cli:fetch_main", "download lm-eval tasks' datasets for --tasks-data (online)"),
        "check": ("repro.evaluation.data_cli:check_main", "check offline that a task-data folder is complete"),
    },
    "study": ("repro.studies.registry:main", "run a study by name: mini, ablation, efficiency, the sweeps (--list)"),
    "report": {
        "tables": ("repro.report.cli:tables_main", "build the zero-shot and efficiency tables from run records"),
        "check": ("repro.report.cli:check_main", "regression-check a run against published numbers or runs"),
        "bench": ("repro.report.bench_table:main", "summarise a pytest-benchmark JSON as a table"),
        "writeup": ("repro.studies.writeup:main", "write results/<study>/README.md and the README's result blocks"),
    },
    "launch": ("repro.launch:main", "print the torchrun command or SLURM script for N nodes x G GPUs"),
    "golden": ("repro.golden:main", "compare fresh runs with the golden loss curves (or --refresh them)"),
}

#: Retired commands -> their replacement (a one-line error on use, never run silently).
MOVED = {"mini": "study mini", "ablation": "study ablation", "efficiency": "study efficiency",
         "tables": "report tables", "check": "report check", "writeup": "report writeup",
         "bench-table": "report bench", "eval-data": "eval fetch | eval check"}


def _usage(table: dict, prog: str) -> str:
    rows = [(f"{name} {sub}" if sub else name, help_) for name, entry in table.items()
            for sub, (_, help_) in (entry.items() if isinstance(entry, dict) else [("", entry)])]
    width = max(len(r[0]) for r in rows)
    return "\n".join([f"usage: {prog} <command> [options]", "", "commands:",
                      *(f"  {name:<{width}}  {help_}" for name, help_ in rows)])


def resolve(argv: list[str]) -> tuple[Entry, str, list[str]]:
    """The entry ``argv`` names, the words that named it, and the arguments left for it.

    Raises:
        ReproError: an unknown command or subcommand (with the valid ones), or a retired command.
    """
    name = argv[0]
    if name in MOVED:
        raise ReproError(f"'{name}' is now '{MOVED[name]}'")
    if name not in COMMANDS:
        raise ReproError(unknown_name("command", name, list(COMMANDS)))
    entry = COMMANDS[name]
    if not isinstance(entry, dict):
        return entry, name, argv[1:]
    if name == "eval" and len(argv) > 1 and argv[1].startswith("-"):
        return entry["run"], "eval run", argv[1:]  # `eval --checkpoint ...`: the evaluation itself
    if len(argv) == 1 or argv[1] not in entry:
        raise ReproError(unknown_name(f"'{name}' subcommand", argv[1] if len(argv) > 1 else "", list(entry)))
    return entry[argv[1]], f"{name} {argv[1]}", argv[2:]


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command. Returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # How the user called us: ``dirmoe-bench`` (console script) or ``python -m repro``.
    prog = "dirmoe-bench" if Path(sys.argv[0]).name == "dirmoe-bench" else "python -m repro"
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(COMMANDS, prog))
        return 0
    group = COMMANDS.get(argv[0])
    if isinstance(group, dict) and (len(argv) == 1 or argv[1] in ("-h", "--help")):
        print(_usage({argv[0]: group}, prog))
        return 0
    try:
        (target, _), words, rest = resolve(argv)
        program = rest[rest.index("--") + 1:] if words == "launch" and "--" in rest else []
        if program:  # the command torchrun is to run: a moved or unknown one is refused here, not on every rank
            resolve(program)
        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        return int(func(rest, prog=f"{prog} {words}") or 0)
    except ReproError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
