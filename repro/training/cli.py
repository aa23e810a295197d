"""``python -m repro train``: train one named experiment (one process, or every rank under torchrun).

Examples::

    python -m repro train --experiment remoe-tiny --set schedule.steps=50 --set router.options.l1_coeff_multiplier=1.1 --out runs/r
    python -m repro train --out runs/r --resume --set optimizer.lr=5e-4    # e.g. after a NaN loss
    torchrun --nproc_per_node=2 -m repro train --experiment switch-tiny --set parallel.ep=2 --out runs/switch-ep2

A finished run gets ``record.json`` (read by ``report tables``/``check``; ``eval run`` adds zero-shot results).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from repro.errors import ReproError


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Train one experiment on megatron-core (CPU/gloo or GPU; "
                                     "works under torchrun).")
    parser.add_argument("--experiment", "-e", help="an experiment name (see --list)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field as a dotted path (schedule.steps=100, optimizer.lr=1e-3, "
                        "parallel.ep=2, router.options.NAME=VALUE); repeatable")
    parser.add_argument("--out", "-o", help="the run directory (new or empty; with --resume, the run's)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its newest checkpoint, with its own settings (config.json) "
                        "and only the --set changes given, each printed")
    parser.add_argument("--extend", action="store_true",
                        help="with --resume: reopen a finished run to train on to a larger --set schedule.steps "
                        "(its summary and record are written again)")
    parser.add_argument("--list", action="store_true", help="list the experiments and exit")
    parser.add_argument("--list-routers", action="store_true",
                        help="list the routers with experiments (not their variants) and exit")
    parser.add_argument("--show", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("--stop-after", type=int, default=None, metavar="STEPS",
                        help="stop after this many completed steps without a final checkpoint (resume later)")
    parser.add_argument("--tensorboard", metavar="DIR", default=None,
                        help="also write TensorBoard events to DIR (logging.tensorboard=true; needs the extra "
                        "'tensorboard')")
    parser.add_argument("--progress", dest="progress", action="store_true", default=None, help="force the progress bar")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    return parser


def main(argv: list[str], prog: str = "python -m repro train") -> int:
    """Run ``train`` on ``argv``; exit status 0, :data:`~repro.training.preemption.EXIT_STOPPED` (75) after a stop
    signal, 130 after Ctrl-C."""
    from pathlib import Path

    from repro.config import apply_overrides
    from repro.experiments import describe, experiment_names, experiment_routers, get_experiment

    args = _parser(prog).parse_args(argv)
    if args.tensorboard is not None:
        if not args.tensorboard:
            raise ReproError("--tensorboard needs a directory")
        # Two overrides like any --set; a resumed run takes them through its stored config.
        args.overrides += ["logging.tensorboard=true", f"logging.tensorboard_dir={args.tensorboard}"]
    if args.list:
        for name in experiment_names():
            print(describe(get_experiment(name)))
        return 0
    if args.list_routers:
        print("\n".join(experiment_routers()))
        return 0

    config = None
    if args.resume and args.out and not args.show:
        # The run's own settings, not the experiment's defaults: only what is set explicitly changes.
        from repro.training.run_dir import RunPaths, stored_config

        stored = stored_config(RunPaths(Path(args.out)))[0]
        if args.experiment and args.experiment != stored.name:
            raise ReproError(f"{args.out}: holds a run of experiment '{stored.name}', not '{args.experiment}'")
        config = apply_overrides(stored, args.overrides) if args.overrides else None
    elif args.experiment:
        config = apply_overrides(get_experiment(args.experiment), args.overrides)
    elif args.overrides:
        raise ReproError("--set needs --experiment (or --resume --out RUN_DIR to change a run's settings)")
    elif not args.resume and not args.show:
        raise ReproError("give --experiment NAME (see --list) or --resume")

    if args.show:
        if config is None:
            raise ReproError("--show needs --experiment")
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(config)), end="")
        effective = config.router_options_in_effect()
        if effective:
            print(f"# router options in effect (router.options over {config.router.name}'s defaults):")
            print("\n".join(f"#   {key}: {value!r}" for key, value in effective.items()))
        return 0
    if not args.out:
        raise ReproError("give --out DIR")
    if args.stop_after is not None and args.stop_after < 0:
        raise ReproError(f"--stop-after must be >= 0, got {args.stop_after}")

    from repro.training.preemption import EXIT_INTERRUPTED, EXIT_STOPPED, RunStopped
    from repro.training.trainer import train  # imports megatron-core: only when training

    try:
        summary = train(config, args.out, resume=args.resume, extend=args.extend, stop_after=args.stop_after,
                        progress=args.progress)
    except RunStopped as stopped:
        # Checkpointed after a signal (a time limit, Ctrl-C); rank 0 said how to resume.
        return EXIT_INTERRUPTED if stopped.signal == "SIGINT" else EXIT_STOPPED
    if int(os.environ.get("RANK", "0")):
        return 0
    if summary.get("stopped_at") is not None:
        print(f"{summary['experiment']}: stopped after step {summary['stopped_at']} (--stop-after), without a final "
              f"checkpoint; resume with: python -m repro train --out {shlex.quote(str(args.out))} --resume",
              file=sys.stderr)
        return 0
    if summary.get("finished_before"):
        return 0
    from repro.records.store import write_run_record

    write_run_record(args.out)
    print(f"{summary['experiment']}: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
          f"{summary['tokens_per_s_mean'] or 0:.0f} tokens/s -> {args.out}", file=sys.stderr)
    return 0
