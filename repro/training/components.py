"""The trainer's components: any object with ``after_step(trainer, row) -> row`` and ``close()``, run after
every step in the order the trainer holds them (validation first, so the logged row carries the validation
loss), each deciding its own cadence; they see the trainer as :class:`TrainerState`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from repro.io_utils import open_in_dir
from repro.records.step_log import LogRow, write_row
from repro.training import checkpoint as ckpt
from repro.training.data import MicroBatchSampler, collate
from repro.training.distributed import all_reduce_mean

if TYPE_CHECKING:
    from repro.config import RunConfig
    from repro.training.distributed import Parallel
    from repro.training.optim import LRScheduler
    from repro.training.run_dir import RunPaths


class TrainerState(Protocol):
    """What the components read and set of the trainer (declared here: the trainer imports its components)."""

    config: RunConfig
    paths: RunPaths
    parallel: Parallel
    device: torch.device
    model: torch.nn.Module  # unwrapped (not megatron's DDP wrapper)
    optimization: Any  # repro.training.optim's CpuOptimization or MegatronOptimization
    scheduler: LRScheduler
    step: int  # completed optimizer steps
    consumed: int  # samples consumed by all ranks together
    components: list[Any]

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def lm_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...


class Validator:
    """Mean validation loss over the same ``iters`` micro-batches per rank, every ``interval`` steps and last."""

    def __init__(self, dataset, interval: int, iters: int, last_step: int) -> None:
        self.dataset, self.interval, self.iters, self.last_step = dataset, interval, iters, last_step

    def after_step(self, trainer: TrainerState, row: LogRow) -> LogRow:
        if self.dataset is None or not self.interval or (row.step % self.interval and row.step != self.last_step):
            return row
        return dataclasses.replace(row, val_loss=self.evaluate(trainer))

    @torch.no_grad()
    def evaluate(self, trainer: TrainerState) -> float:
        """Validation loss in eval mode; training RNG streams untouched, router stats and aux-loss tracker cleared
        so evaluation never leaks into the next step's row."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        from routers.megatron_adapter import reset_routing_stats

        parallel, device = trainer.parallel, trainer.device
        sampler = MicroBatchSampler(trainer.config.data.micro_batch_size, parallel.dp_rank, parallel.dp_size, self.iters)
        devices = [device.index or 0] if device.type == "cuda" else []
        model = trainer.model.eval()
        total = torch.zeros((), dtype=torch.float64)
        try:
            with torch.random.fork_rng(devices=devices):
                for j in range(self.iters):
                    batch = trainer.to_device(collate(self.dataset, sampler.indices(0, j)))
                    total += trainer.lm_loss(batch).double().cpu()
        finally:
            model.train()
            reset_routing_stats(model)
            clear_aux_losses_tracker()
        mean = total / max(1, self.iters)
        return float(all_reduce_mean(mean.reshape(1), parallel.dp_group, parallel.dp_size)[0])

    def close(self) -> None:
        pass


class StepLog:
    """``log.jsonl`` (rank 0, a row per step) and the progress bar (updated every ``interval`` steps)."""

    def __init__(self, path: Path, interval: int, total_steps: int, initial_step: int, is_main: bool, show: bool,
                 desc: str) -> None:
        from tqdm import tqdm

        self.interval, self.total_steps = interval, total_steps
        # Never through a symlink that leads out of the run directory (a planted log.jsonl -> elsewhere).
        self.file = open_in_dir(path.parent, path.name, "a") if is_main else None
        self.bar = tqdm(total=total_steps, initial=initial_step, disable=not show, desc=desc, dynamic_ncols=True)

    def after_step(self, trainer: TrainerState, row: LogRow) -> LogRow:
        if self.file is not None:
            write_row(self.file, row)
        self.bar.update(1)
        if row.step % self.interval == 0 or row.step == self.total_steps:
            self.bar.set_postfix(loss=f"{row.loss:.4f}", lr=f"{row.lr:.2e}", tok_s=f"{row.tokens_per_s:.0f}")
        return row

    def sync(self) -> None:
        """Make the rows written so far durable (before a checkpoint refers to them)."""
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()
            self.file = None


class Checkpointer:
    """Checkpoints every ``interval`` steps and last, syncing ``log`` first (no reference to unwritten rows)."""

    def __init__(self, root: Path, interval: int, last_step: int, log: StepLog) -> None:
        self.root, self.interval, self.last_step, self.log = root, interval, last_step, log
        self.saved: tuple[int, Path] | None = None  # (step, path) of the checkpoint this run wrote last

    def after_step(self, trainer: TrainerState, row: LogRow) -> LogRow:
        if row.step == self.last_step or (self.interval and row.step % self.interval == 0):
            self.save(trainer)
        return row

    def ensure_saved(self, trainer: TrainerState) -> Path:
        """The current step's checkpoint, written unless :meth:`after_step` just did (collective)."""
        if self.saved is not None and self.saved[0] == trainer.step:
            return self.saved[1]
        return self.save(trainer)

    def save(self, trainer: TrainerState) -> Path:
        """Write one checkpoint of the trainer's state (collective)."""
        self.log.sync()
        path = ckpt.save_checkpoint(
            self.root, step=trainer.step, consumed_samples=trainer.consumed, parallel=trainer.parallel,
            experiment=trainer.config.to_dict(), model=trainer.model,
            optimizer_state=trainer.optimization.state_dict(), scheduler_state=trainer.scheduler.state_dict(),
        )
        self.saved = (trainer.step, path)
        return path

    @staticmethod
    def restore(trainer: TrainerState, payload: dict[str, Any]) -> None:
        """Restore optimizer, schedule, data position and, last, RNG (weights load before the optimizer is built)."""
        trainer.optimization.load_state_dict(payload["optimizer"])
        trainer.scheduler.load_state_dict(payload["scheduler"])
        trainer.step, trainer.consumed = int(payload["step"]), int(payload["consumed_samples"])
        ckpt.restore_rng_state(payload["rng"])

    def close(self) -> None:
        pass
