"""``python -m repro train``: train one named experiment (one process, or every rank under torchrun).

Examples::

    python -m repro train --list
    python -m repro train --experiment dirmoe-tiny --out runs/dirmoe-tiny
    python -m repro train --experiment remoe-tiny --set steps=50 --set router_options.l1_coeff_multiplier=1.1 --out runs/r
    python -m repro train --out runs/dirmoe-tiny --resume
    torchrun --nproc_per_node=2 -m repro train --experiment switch-tiny --set ep=2 --out runs/switch-ep2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from repro.errors import ReproError
from repro.training.experiments import EXPERIMENTS, apply_overrides, describe, get_experiment


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train one experiment on megatron-core (CPU/gloo or GPU; works under torchrun).",
    )
    parser.add_argument("--experiment", "-e", help="a registered experiment name (see --list)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an experiment field (e.g. steps=100, lr=1e-3, ep=2) or a router option "
        "(router_options.NAME=VALUE); repeatable",
    )
    parser.add_argument("--out", "-o", help="output directory (config.json, log.jsonl, checkpoints/, summary.json)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    parser.add_argument("--list", action="store_true", help="list the registered experiments and exit")
    parser.add_argument("--show", action="store_true", help="print the resolved experiment as JSON and exit")
    parser.add_argument(
        "--stop-after", type=int, default=None, metavar="STEPS",
        help="stop after this many completed steps without a final checkpoint (resume later)",
    )
    parser.add_argument("--progress", dest="progress", action="store_true", default=None, help="force the progress bar")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    return parser


def main(argv: list[str], prog: str = "python -m repro train") -> int:
    """Run the ``train`` command.

    Args:
        argv: the arguments after ``train``.
        prog: the program name for usage messages.

    Returns:
        The exit status (0 on success).

    Raises:
        ReproError: unknown experiment or key, bad value, missing ``--out``, a missing or corrupt checkpoint
            with ``--resume``.
    """
    args = _parser(prog).parse_args(argv)
    if args.list:
        for name in sorted(EXPERIMENTS):
            print(describe(EXPERIMENTS[name]))
        return 0

    experiment = None
    if args.experiment:
        experiment = apply_overrides(get_experiment(args.experiment), args.overrides)
    elif args.overrides:
        raise ReproError("--set needs --experiment (a resumed run keeps its checkpoint's config)")
    elif not args.resume and not args.show:
        raise ReproError(f"give --experiment NAME (one of: {', '.join(sorted(EXPERIMENTS))}) or --resume")

    if args.show:
        if experiment is None:
            raise ReproError("--show needs --experiment")
        print(json.dumps(experiment.to_dict(), indent=2))
        return 0
    if not args.out:
        raise ReproError("give --out DIR")
    if args.stop_after is not None and args.stop_after < 0:
        raise ReproError(f"--stop-after must be >= 0, got {args.stop_after}")

    from repro.training.loop import train  # imports megatron-core: only when training

    summary = train(experiment, args.out, resume=args.resume, stop_after=args.stop_after, progress=args.progress)
    if summary.get("stopped_at") is None and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"{summary['experiment']}: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
            f"{summary['tokens_per_s_mean'] or 0:.0f} tokens/s -> {args.out}",
            file=sys.stderr,
        )
    return 0
