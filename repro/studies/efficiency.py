"""``python -m repro study efficiency``: iteration time and TFLOP/s per device of every router and dense, on 1..N GPUs.

Each run (default: every router with experiments but megatron's, then dense) trains the first iterations of
``<router>-<flavour>`` on synthetic tokens; reports median iteration time, tokens/s, TFLOP/s per device
(:mod:`repro.records.flops`) to ``--out`` (docs/efficiency.md).

Defaults, each one option away:

1. **Synthetic tokens at GPT-2's vocabulary**: no data set needed, the papers' embedding sizes (Hash's load
   follows the synthetic ids; ``--set data.source=pile:PREFIX`` for real tokens).
2. **The papers' per-device work** (micro-batches of 16 x 4 per GPU), so per-GPU figures compare with theirs.
3. **The recipe's first iterations**: no checkpoint, validation or dense start, so the routed model is timed near
   initialisation; ``--init-from DIR`` times the steady state (:func:`resolve_init_from`).
4. **Warm-up and metrics iterations excluded, median reported**: warm-up carries CUDA init, allocator growth and
   torch.compile.
5. **On one device, all runs resident in one process, stepped in turn** (:mod:`repro.training.interleave`, order
   reversed every other round, GC by hand): ratios to Switch come from the same rounds, 95% interval by batch means
   (:func:`repro.stats.timing_ratio`); ``--separate`` (always with ``--gpus N``) reports times, no ratios.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repro.errors import ReproError, unknown_name
from repro.launch import Launch
from repro.studies.engine import OneLineParser, Run, Study, check_flags, check_out_dir, claim, pick, run_study

#: Flavour -> devices its recipe's global batch is spread over in its source (papers: ~8 GPUs; mini: 1 CPU).
REFERENCE_DEVICES: dict[str, int] = {"185m": 8, "tiny": 1}
#: GPT-2 BPE's vocabulary (the papers' tokenizer).
GPT2_VOCAB = 50257
DEFAULT_WARMUP = 3
DEFAULT_ITERS: dict[str, int] = {"185m": 20, "tiny": 10}
COMMAND = "python -m repro study efficiency"
FORMATS = ("md", "csv", "tex")
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


@dataclass(frozen=True)
class RunSpec:
    """One measured run.

    Args:
        label: directory under ``runs/`` and record ``run_id``.
        router: a router with experiments, or ``dense``.
        overrides: this run's own dot-list overrides.
        init_from: trained checkpoint to start from ("": initialisation).
        start_step: that checkpoint's step.
    """

    label: str
    router: str
    overrides: tuple[str, ...] = ()
    init_from: str = ""
    start_step: int = 0

    def __post_init__(self) -> None:
        if not _LABEL.match(self.label):
            raise ValueError(f"run label '{self.label}' must be letters, digits and _.+- (a directory name)")


@dataclass(frozen=True)
class EfficiencyPlan:
    """Everything the command measures, decided (and checked, :func:`parse`) before any run starts.

    Args:
        runs: the runs, in order.
        warmup: iterations left out of the statistics.
        iters: iterations measured.
        out_dir: the output directory.
        published: show the published rows beside the runs.
        formats: table formats written.
        flops_attention: how the FLOPs count takes attention (:data:`repro.records.flops.ATTENTION_COUNTS`).
        interleave: step every run in this process in turn (module docstring, 5); else a process per run.
        flavour, devices, accumulation, vocab_size, overrides, micro_batch_size, global_batch_size: as
            :func:`efficiency_overrides` (``overrides``: of every run).
    """

    runs: tuple[RunSpec, ...]
    flavour: str
    devices: int
    accumulation: int
    warmup: int
    iters: int
    vocab_size: int
    overrides: tuple[str, ...]
    out_dir: str
    published: bool = False
    formats: tuple[str, ...] = FORMATS
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    flops_attention: str = "causal"
    interleave: bool = False

    def __post_init__(self) -> None:  # the numbers and the flavour are checked by :func:`parse`, naming the flag
        labels = [r.label for r in self.runs]
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        if duplicates:
            raise ValueError(f"run label(s) given twice: {', '.join(duplicates)}")
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown:
            raise ValueError(f"unknown table format(s) {', '.join(unknown)}; valid: {', '.join(FORMATS)}")

    @property
    def steps_run(self) -> int:
        """Iterations each run trains: warm-up, measured, and one untimed metrics iteration."""
        return self.warmup + self.iters + 1

    def run(self, spec: RunSpec) -> Run:
        """The study's run of ``spec`` (:func:`efficiency_overrides`; ReproError on a bad router or override).
        A run overriding ``data.micro_batch_size`` keeps the plan's global batch (other accumulation steps)."""
        kwargs = dict(devices=self.devices, accumulation=self.accumulation, steps=self.steps_run,
                      vocab_size=self.vocab_size, micro_batch_size=self.micro_batch_size, init_from=spec.init_from)
        global_batch = self.global_batch_size
        if global_batch is None and any(o.startswith("data.micro_batch_size=") for o in spec.overrides):
            planned = efficiency_overrides(spec.router, self.flavour, overrides=self.overrides, **kwargs)
            global_batch = int(planned[-1].partition("=")[2])  # (the list ends with data.global_batch_size=N)
        overrides = efficiency_overrides(spec.router, self.flavour, global_batch_size=global_batch,
                                         overrides=(*self.overrides, *spec.overrides), **kwargs)
        return Run(spec.label, f"{spec.router}-{self.flavour}", tuple(overrides))

    def run_dir(self, spec: RunSpec) -> Path:
        """Where the run writes."""
        return Path(self.out_dir) / "runs" / spec.label

    def study(self) -> Study:
        """The measurement as a :class:`~repro.studies.engine.Study`: each run launched on its own, then its record."""
        runs = tuple(self.run(spec) for spec in self.runs)
        return Study("efficiency", runs, str(Path(self.out_dir) / "runs"), self.out_dir, task=_write_record,
                     launch=Launch(1, self.devices), train_args=("--stop-after", str(self.steps_run)), settings=self)


# ------------------------------------------------------------------------------------------ configs
def default_accumulation(flavour: str) -> int:
    """Micro-batches per device that keep the recipe's per-device work (module docstring, default 2)."""
    from repro.experiments import build_experiment

    recipe = build_experiment("switch", flavour).data
    per_device = recipe.global_batch_size // REFERENCE_DEVICES[flavour]
    return max(1, per_device // recipe.micro_batch_size)


def efficiency_overrides(
    router: str, flavour: str, *, devices: int = 1, accumulation: int | None = None, steps: int = DEFAULT_WARMUP + 10,
    vocab_size: int = GPT2_VOCAB, micro_batch_size: int | None = None, global_batch_size: int | None = None,
    overrides: tuple[str, ...] | list[str] = (), init_from: str = "",
) -> list[str]:
    """The dot-list turning ``<router>-<flavour>`` into its efficiency run (module docstring), then ``overrides``;
    ``python -m repro train --experiment <router>-<flavour> --set ...`` with it starts each run.

    Args:
        router: a router with experiments or ``dense``.
        flavour: ``185m`` or ``tiny``.
        devices: processes sharing an iteration (data-parallel size x ``parallel.tp``).
        accumulation: micro-batches per device and iteration (None: :func:`default_accumulation`).
        steps: iterations before the run stops (the schedule keeps the recipe's length when longer).
        vocab_size: synthetic tokens' vocabulary.
        micro_batch_size: sequences per micro-batch (None: the recipe's).
        global_batch_size: sequences per iteration, instead of micro x accumulation x data-parallel size.
        overrides: further overrides (``--set``), applied last.
        init_from: a trained checkpoint to start from, routers' schedules at its step ("": none).

    Returns:
        The ``key=value`` assignments, in order.

    Raises:
        ReproError: an unknown router or flavour, a bad override, or a batch that does not divide.
    """
    from repro.config import MEGATRON_ROUTER, _router_option_fields, apply_overrides
    from repro.experiments import build_experiment

    base = build_experiment(router, flavour)  # (ReproError naming an unknown flavour)
    name = base.router.name
    dense_start = name not in (None, MEGATRON_ROUTER) and "dense_fraction" in _router_option_fields(name)
    own = [
        "data.source=synthetic", f"data.vocab_size={vocab_size}", "data.synthetic_samples=0",
        f"data.micro_batch_size={micro_batch_size or base.data.micro_batch_size}",
        # The trainer checkpoints at the schedule's last step: keep it beyond the steps run.
        f"schedule.steps={max(base.schedule.steps, steps + 1)}", "checkpoint.interval=0", "validation.interval=0",
        # A dense start (Lory's) would time the dense FFN.
        *(["router.options.dense_fraction=0"] if dense_start else []),
        # Routing metrics on the first and last (untimed) iterations only.
        f"logging.metrics_interval={steps}",
        *([f"checkpoint.init_from={init_from}", "checkpoint.init_router_step=true"] if init_from else []),
        *overrides,
    ]
    # Read the micro-batch and tp the overrides leave, check the list with a one-micro-batch global batch.
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        given = OmegaConf.from_dotlist([item for item in own if not item.startswith("router.options.")])
        if OmegaConf.select(given, "data.global_batch_size") is not None:
            # The batch is this command's to set (it would be silently overridden below).
            raise ReproError("--set data.global_batch_size: use --global-batch or --accumulation instead")
        micro = int(OmegaConf.select(given, "data.micro_batch_size", default=base.data.micro_batch_size))
        tp = int(OmegaConf.select(given, "parallel.tp", default=base.parallel.tp))
    except (OmegaConfBaseException, TypeError, ValueError):
        apply_overrides(base, own)  # raises the one-line error naming the bad assignment
        raise
    config = apply_overrides(base, [*own, f"data.global_batch_size={micro}"])
    if devices % tp:
        raise ReproError(f"--gpus {devices} is not a multiple of parallel.tp={tp}")
    dp = devices // tp
    global_batch = global_batch_size or micro * (accumulation or default_accumulation(flavour)) * dp
    if global_batch % (micro * dp):
        raise ReproError(
            f"--global-batch {global_batch} is not a multiple of micro-batch x data-parallel size = {micro} x {dp}"
        )
    if config.schedule.steps <= steps:
        raise ReproError(f"schedule.steps={config.schedule.steps}: must be above the {steps} iterations run")
    return [*own, f"data.global_batch_size={global_batch}"]


def efficiency_config(router: str, flavour: str, **kwargs: Any):
    """The efficiency RunConfig of ``router`` at ``flavour`` (arguments and errors: :func:`efficiency_overrides`)."""
    from repro.config import apply_overrides
    from repro.experiments import build_experiment

    overrides = efficiency_overrides(router, flavour, **kwargs)
    return apply_overrides(build_experiment(router, flavour), overrides)


# ------------------------------------------------------------------------------------------ records
def _device_name() -> str | None:
    """The GPU's name via nvidia-smi (no CUDA context in this process), else None (the record's default)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip().splitlines() or [None])[0]


def _write_record(study: Study, run: Run) -> Path:
    """The study's task after each run: its record, with this machine's device."""
    import torch

    from repro.records.store import environment_info, record_from_run_dir, write_record

    plan: EfficiencyPlan = study.settings
    spec = next(r for r in plan.runs if r.label == run.run_id)
    run_dir = study.run_dir(run)
    device = _device_name() if torch.cuda.is_available() else None
    environment = environment_info(num_processes=plan.devices, device=device)
    record = record_from_run_dir(run_dir, warmup=plan.warmup, run_id=run.run_id, environment=environment,
                                 flops_attention=plan.flops_attention, start_step=spec.start_step)
    return write_record(record, run_dir / "record.json")


# ------------------------------------------------------------------------------------------ command line
def _variant(text: str) -> RunSpec:
    label, sep, rest = text.partition("=")
    parts = [p.strip() for p in rest.split(",")] if sep else []
    if not sep or not label or not parts or not parts[0] or any("=" not in p for p in parts[1:]):
        raise ReproError(f"--variant expects LABEL=ROUTER[,KEY=VALUE...], got '{text}'")
    try:
        return RunSpec(label.strip(), parts[0], tuple(parts[1:]))
    except ValueError as exc:
        raise ReproError(f"--variant: {exc}") from None


def resolve_init_from(values: list[str], runs: list[RunSpec]) -> list[RunSpec]:
    """``runs`` with the trained checkpoints ``--init-from`` names for them (module docstring, default 3).

    Args:
        values: at most one ``DIR`` (each run from the first of ``DIR/<label>``, ``DIR/<router>``, ``DIR``
            holding a checkpoint of its router), and ``LABEL=PATH`` for single runs.

    Returns:
        The runs with ``init_from`` (absolute checkpoint path) and ``start_step`` set.

    Raises:
        ReproError: two ``DIR``, an unknown label, or a run without a checkpoint of its router.
    """
    from repro.training import checkpoint as ckpt

    labels = {run.label for run in runs}
    per_run, shared = {}, []
    for value in values:
        label, sep, path = value.partition("=")
        if sep and label in labels:
            per_run[label] = Path(path)
        elif sep and not Path(value).exists():
            raise ReproError(f"--init-from {value}: no run labelled '{label}'; runs: {', '.join(sorted(labels))}")
        else:
            shared.append(Path(value))
    if len(shared) > 1:
        raise ReproError("--init-from: give one DIR holding a run per router (and LABEL=PATH for single runs)")
    if not values:
        return runs
    resolved = []
    for run in runs:
        # (dict.fromkeys: a run labelled as its router names its folder once)
        folders = dict.fromkeys((shared[0] / run.label, shared[0] / run.router, shared[0])) if shared else {}
        candidates = [per_run[run.label]] if run.label in per_run else list(folders)
        info = ckpt.find_router_checkpoint(candidates, run.router)
        if info is None:
            where = ", ".join(str(c) for c in candidates) or "(no --init-from for it)"
            raise ReproError(f"--init-from: no checkpoint of router '{run.router}' for run '{run.label}' in {where}")
        resolved.append(dataclasses.replace(run, init_from=str(info.path.resolve()), start_step=info.step))
    return resolved


def parse(argv: list[str], prog: str) -> EfficiencyPlan:
    """The plan from the command line, every run's config built and checked before any work.

    Raises:
        ReproError: a bad argument (one line naming it).
    """
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default="all",
                   help="comma-separated routers and dense, or all (python -m repro train --list-routers)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=ROUTER[,KEY=VALUE...]",
                   help="an extra run of ROUTER with its own overrides, e.g. "
                   "dirmoe-eager=dirmoe,router.options.compile_elementwise=never (repeatable)")
    p.add_argument("--flavour", default=None, help="185m or tiny (default: 185m with a GPU, tiny without)")
    p.add_argument("--gpus", type=int, default=1,
                   help="processes per iteration, one per GPU (gloo processes on CPU); N > 1 runs torchrun")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="iterations left out of the statistics")
    p.add_argument("--iters", type=int, default=None, help="iterations measured (default 20 for 185m, 10 for tiny)")
    p.add_argument("--accumulation", type=int, default=None,
                   help="micro-batches per device and iteration (default: the papers' per-GPU work, 4 for 185m)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per iteration instead of --accumulation")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default: the recipe's)")
    p.add_argument("--vocab-size", type=int, default=GPT2_VOCAB, help="vocabulary of the synthetic tokens")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every run")
    p.add_argument("--out", default=None, help="output directory (default runs/efficiency-<flavour>-<N>dev)")
    p.add_argument("--published", action="store_true", help="show the published rows beside the runs")
    p.add_argument("--format", default=",".join(FORMATS), help="table formats: any of md,csv,tex")
    p.add_argument("--flops-attention", default="causal", choices=("causal", "full"),
                   help="FLOPs count of attention scores: causal (current Megatron-LM, half the s x s square; "
                   "the DirMoE paper's TFLOP/s) or full (the whole square, ReMoE's fork)")
    p.add_argument("--separate", action="store_true",
                   help="a fresh process per run, one after another (always with --gpus N > 1); no ratios are "
                   "formed. Default on one device: every run in this process, one step of each in turn")
    p.add_argument("--init-from", action="append", default=[], metavar="DIR | LABEL=PATH",
                   help="time from trained checkpoints: DIR holds a run (or checkpoint) per router, DIR/<label> "
                   "or DIR/<router>; LABEL=PATH for one run (repeatable)")
    args = p.parse_args(argv)
    # torch and the routers only now: --help answers at once.
    import torch

    from repro.config import MEGATRON_ROUTER
    from repro.experiments import experiment_routers

    on_gpu = torch.cuda.is_available()
    everyone = [r for r in experiment_routers() if r != MEGATRON_ROUTER]
    if "WORLD_SIZE" in os.environ:
        raise ReproError("run python -m repro study efficiency without torchrun: it starts torchrun itself for --gpus N > 1")
    check_flags(args, gpus=1, warmup=0, iters=1, accumulation=1, global_batch=1, micro_batch=1, vocab_size=2)
    if on_gpu and args.gpus > torch.cuda.device_count():
        raise ReproError(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} visible GPU(s)")
    flavour = args.flavour or ("185m" if on_gpu else "tiny")
    if flavour not in REFERENCE_DEVICES:
        raise ReproError(f"--flavour: unknown flavour '{flavour}'; valid: {', '.join(REFERENCE_DEVICES)}")
    if args.accumulation is not None and args.global_batch is not None:
        raise ReproError("give --accumulation or --global-batch, not both")
    # megatron's router only by name: "all" leaves it out.
    names = everyone if args.router.strip() == "all" else pick(args.router, experiment_routers(), "--router", "router")
    runs = [RunSpec(name, name) for name in names] + [_variant(v) for v in args.variant]
    for run in runs:
        if run.router not in experiment_routers():
            raise ReproError(f"--variant {run.label}: {unknown_name('router', run.router, everyone)}")
    runs = resolve_init_from(args.init_from, runs)
    try:
        plan = EfficiencyPlan(
            runs=tuple(runs), flavour=flavour, devices=args.gpus,
            accumulation=args.accumulation or default_accumulation(flavour),
            warmup=args.warmup, iters=args.iters or DEFAULT_ITERS[flavour], vocab_size=args.vocab_size,
            overrides=tuple(args.set), out_dir=args.out or f"runs/efficiency-{flavour}-{args.gpus}dev",
            published=args.published, formats=tuple(f.strip() for f in args.format.split(",") if f.strip()),
            micro_batch_size=args.micro_batch, global_batch_size=args.global_batch,
            flops_attention=args.flops_attention, interleave=args.gpus == 1 and not args.separate,
        )
    except ValueError as exc:
        raise ReproError(str(exc)) from None
    study = plan.study()  # every run's config built: a bad override is an error now
    for run in study.runs:
        if run.config().model.precision == "bf16" and not on_gpu:
            raise ReproError(
                f"{run.run_id}: flavour '{flavour}' trains in bf16, which needs a GPU; on CPU use --flavour tiny "
                "(or --set model.precision=fp32)"
            )
        # Checked before any work: found only at the first forward, it would stop every run stepped in turn.
        fused = run.config().model.fused_cross_entropy
        if fused.startswith("cce") and not importlib.util.find_spec("cut_cross_entropy"):
            raise ReproError(f"{run.run_id}: model.fused_cross_entropy={fused} needs cut-cross-entropy==25.1.1 "
                             "(the 'fused' extra, GPU only); fused_cross_entropy=torch_compile runs anywhere")
    check_out_dir(study)  # before any work: another command's results stay
    claim(study, fresh=True, check_only=True)
    return plan


def main(argv: list[str], prog: str = COMMAND) -> int:
    """Measure every run, write records, tables and summary. Returns 1 when a run failed (others still reported)."""
    if "--profile" in argv:
        raise ReproError("--profile is now its own study: python -m repro study router-costs")
    from repro.wheelhouse import check_requirements

    check_requirements()
    plan = parse(argv, prog)
    import torch

    from repro.records.store import load_record
    from repro.studies.efficiency_report import write_command_outputs

    config = plan.run(plan.runs[0]).config()
    print(
        f"{len(plan.runs)} run(s) of {plan.flavour} x {plan.steps_run} iterations ({plan.warmup} warm-up) on "
        f"{plan.devices} {'GPU(s)' if torch.cuda.is_available() else 'CPU process(es)'}, "
        f"{config.data.global_batch_size} x {config.seq_length} tokens per iteration -> {plan.out_dir}",
        flush=True,
    )
    outcome = _interleaved(plan) if plan.interleave else run_study(plan.study(), fresh=True)
    records = {r.label: load_record(plan.run_dir(r) / "record.json")
               for r in plan.runs if r.label not in outcome["failed"]}
    write_command_outputs(plan, records, outcome["failed"], outcome["seconds"], argv, outcome.get("stopped_after"))
    return 1 if outcome["failed"] or outcome.get("stopped_after") else 0


def _interleaved(plan: EfficiencyPlan) -> dict[str, Any]:
    """Train every run in this process, stepped in turn, then write the records. Returns the outcome as
    :func:`repro.studies.engine.run_study` (``failed``: every run, when the training failed) and ``stopped_after``:
    the steps run when a stop signal ended the rounds early (None: all of them)."""
    import time

    from repro.training.interleave import train_interleaved

    study = plan.study()
    claim(study, fresh=True)  # (parse checked the output directory)
    start, failed, steps = time.perf_counter(), {}, plan.steps_run
    runs = [(spec.label, plan.run(spec).config(), plan.run_dir(spec)) for spec in plan.runs]
    try:
        steps = min(train_interleaved(runs, steps=plan.steps_run, progress_every=max(1, plan.steps_run // 10)).values())
    except ReproError as exc:
        failed = {spec.label: str(exc) for spec in plan.runs}
        print(f"interleaved training FAILED: {exc}", flush=True)
    # Stopped by a signal (gpu_measure.sh's time limit), every run has the same rounds: recorded as far as they go.
    for run in study.runs if not failed else ():
        try:
            _write_record(study, run)
        except ReproError as exc:
            stopped = f"stopped after {steps} of {plan.steps_run} steps: " if steps < plan.steps_run else ""
            failed[run.run_id] = f"{stopped}{exc}"
    wall = time.perf_counter() - start
    print(f"  {len(plan.runs)} run(s) interleaved in {wall:.0f} s", flush=True)
    return {"failed": failed, "seconds": {spec.label: wall for spec in plan.runs},
            "stopped_after": steps if steps < plan.steps_run else None}
