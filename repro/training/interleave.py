"""Several runs trained in one process, one step of each in turn: the timing that pins a ratio between routers.

Separate processes differ as much as routers do; here all runs stay resident and :func:`train_interleaved` steps
them round by round (docs/efficiency.md): odd rounds reversed (:func:`round_order`), GC only between rounds
(Megatron-LM's ``--manual-gc``), each run's own CUDA peak memory (:class:`_OwnMemory`), and a profiled step
(``logging.trace_step``) of that run alone. Run directories as :func:`repro.training.trainer.train` writes them,
no checkpoints; step ``s`` is round ``s``. One process and device: tp = ep = 1. A stop signal (SIGINT, SIGTERM,
SIGUSR1: :mod:`repro.training.preemption`) ends it after the round in progress, every run at the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from repro.config import RunConfig
from repro.errors import ReproError


def round_order(labels: Sequence[str], round_index: int) -> list[str]:
    """Run order of 0-based round ``round_index``: odd rounds reversed, so no run always follows the GC."""
    return list(labels) if round_index % 2 == 0 else list(reversed(labels))


def train_interleaved(
    runs: Sequence[tuple[str, RunConfig, Path]], *, steps: int, progress_every: int = 0
) -> dict[str, int]:
    """Train every run for ``steps`` steps, one step of each in turn (module docstring).

    Args:
        runs: ``(label, config, run directory)``; directories new or empty.
        steps: rounds; below each ``schedule.steps`` (no checkpoint is written).
        progress_every: print a line every this many rounds (0: never).

    Returns:
        ``{label: steps completed}``: ``steps`` each, or fewer (the same for all) after a stop signal.

    Raises:
        ReproError: tp/ep > 1, a schedule ending within ``steps``, a busy run directory, a non-finite loss.
    """
    from repro.model import parallel as model_parallel
    from repro.training.preemption import StopRequest
    from repro.training.run_dir import RunPaths, run_lock, start_state
    from repro.training.trace import StepTrace
    from repro.training.trainer import NonFiniteLoss, Trainer, aux_loss_scale_restored

    if not runs:
        raise ReproError("no runs to interleave")
    for label, config, _ in runs:
        if config.parallel.tp != 1 or config.parallel.ep != 1:
            raise ReproError(f"{label}: interleaved runs share one process and device; need parallel.tp = ep = 1")
        if config.schedule.steps <= steps:
            raise ReproError(f"{label}: schedule.steps={config.schedule.steps} must be above the {steps} steps run")
    if model_parallel.is_initialized():
        raise ReproError("train_interleaved starts its own process group: call it outside a training")
    labels = [label for label, _, _ in runs]
    with contextlib.ExitStack() as stack:
        paths = {label: RunPaths(Path(run_dir)) for label, _, run_dir in runs}
        configs = {}
        for label, config, _ in runs:
            stack.enter_context(run_lock(paths[label]))
            configs[label] = start_state(paths[label], config, resume=False)[0]
        info = model_parallel.init_distributed(tp=1, ep=1, seed=configs[labels[0]].seed)
        stack.callback(model_parallel.destroy_distributed)
        stack.enter_context(aux_loss_scale_restored())
        trainers: dict[str, Trainer] = {}
        traces: dict[str, StepTrace | None] = {}
        try:
            memory = _OwnMemory(info.device)
            for label in labels:
                with memory.owned_by(label):
                    trainer = trainers[label] = Trainer(configs[label], paths[label], None, info.device, progress=False)
                # The trace is taken around the step itself (one profiler at a time), not by the component.
                traces[label] = next((c for c in trainer.components if isinstance(c, StepTrace)), None)
                trainer.components = [c for c in trainer.components if c is not traces[label]]
            with StopRequest("Ctrl-C: stopping after this round (Ctrl-C again: at once)").installed() as stop:
                _step_rounds(trainers, traces, labels, steps, progress_every, memory, stop)
        except NonFiniteLoss as exc:
            raise ReproError(f"{exc} (interleaved run; its log is kept in its run directory)") from None
        finally:
            for trainer in trainers.values():
                trainer.close()
        return {label: trainer.step for label, trainer in trainers.items()}


class _OwnMemory:
    """Each run's own CUDA memory peak: resident bytes + largest rise in one step (other rows: the process's)."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.owned: dict[str, int] = {}
        self.rise: dict[str, int] = {}

    @contextlib.contextmanager
    def owned_by(self, label: str):
        """Count what is allocated inside the block as ``label``'s resident memory."""
        before = torch.cuda.memory_allocated() if self.cuda else 0
        yield
        if self.cuda:
            self.owned[label] = self.owned.get(label, 0) + torch.cuda.memory_allocated() - before

    def step(self, label: str, first: bool, run_step):
        """Run ``run_step()`` (a step of ``label``) and return its row with the run's own peak."""
        if not self.cuda:
            return run_step()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        # The optimizer's state appears in the first step and stays: the run's own.
        with self.owned_by(label) if first else contextlib.nullcontext():
            row = run_step()
        self.rise[label] = max(self.rise.get(label, 0), torch.cuda.max_memory_allocated() - base)
        own = self.owned.get(label, 0) + self.rise[label]
        return dataclasses.replace(row, peak_memory_bytes=int(own))


def _step_rounds(trainers, traces, labels, steps, progress_every, memory, stop) -> None:
    start, last_ms = time.perf_counter(), {}
    enabled = gc.isenabled()
    gc.disable()
    try:
        for round_index in range(steps):
            gc.collect()  # between rounds, never inside a timed step (would hit one router at random)
            for label in round_order(labels, round_index):
                trainer, tracer = trainers[label], traces[label]
                tracing = tracer is not None and trainer.step + 1 == tracer.step
                if tracing:
                    tracer.start(trainer.model)
                row = memory.step(label, trainer.step == 0, trainer.train_step)
                if tracing:
                    tracer.stop(row.iter_time_s)
                for component in trainer.components:
                    row = component.after_step(trainer, row)
                last_ms[label] = row.iter_time_s * 1e3
            if progress_every and (round_index + 1) % progress_every == 0:
                times = "  ".join(f"{label} {last_ms[label]:.0f} ms" for label in labels)
                print(f"  round {round_index + 1}/{steps} ({time.perf_counter() - start:.0f} s)  {times}", flush=True,
                      file=sys.stderr)
            if stop.signum:
                print(f"stopped by {signal.Signals(stop.signum).name} after round {round_index + 1} of {steps}",
                      flush=True, file=sys.stderr)
                return
    finally:
        if enabled:
            gc.enable()
