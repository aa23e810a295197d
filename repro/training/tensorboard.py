"""TensorBoard events from the training log's rows (the optional extra ``tensorboard``).

Rank 0 writes each logging step's row: ``train/<field>``, ``train/aux/<name>[/layer<l>]``,
``routing/<metric>/layer<l>``, ``router/<name>``, ``val/loss``, and per-expert histograms
``experts/<metric>/layer<l>`` (bucket i = expert i's value). Layers count from 1. A resume passes
``purge_step`` to drop events written after the checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from repro.errors import ReproError
from repro.records.step_log import LogRow

if TYPE_CHECKING:
    from repro.training.components import TrainerState


def _require_tensorboard() -> None:
    if importlib.util.find_spec("tensorboard") is None:
        raise ReproError(
            "logging.tensorboard needs TensorBoard, which is not installed: pip install 'dirmoe-bench[tensorboard]'"
        )


class TensorBoardLog:
    """The trainer component writing TensorBoard events into ``log_dir`` on rank 0 (``is_main``)."""

    def __init__(self, log_dir: Path, interval: int, last_step: int, initial_step: int, is_main: bool) -> None:
        _require_tensorboard()
        self.interval, self.last_step, self.writer = interval, last_step, None
        if is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(log_dir), purge_step=initial_step + 1 if initial_step else None)

    def after_step(self, trainer: TrainerState, row: LogRow) -> LogRow:
        if self.writer is not None:
            if row.step % self.interval == 0 or row.step == self.last_step:
                self.write(row)
            elif row.val_loss is not None:
                self.writer.add_scalar("val/loss", row.val_loss, row.step)
        return row

    def write(self, row: LogRow) -> None:
        """Write every value of ``row`` at its step (rank 0)."""
        w, step = self.writer, row.step
        for name in ("loss", "lm_loss", "lr", "grad_norm", "tokens_per_s", "iter_time_s"):
            w.add_scalar(f"train/{name}", getattr(row, name), step)
        if row.val_loss is not None:
            w.add_scalar("val/loss", row.val_loss, step)
        for name, value in row.aux_losses.items():
            w.add_scalar(f"train/aux/{name}", value, step)
        for prefix, per_layer_values in (("train/aux", row.aux_losses_per_layer), ("routing", row.routing)):
            for name, per_layer in per_layer_values.items():
                for layer, value in enumerate(per_layer, 1):
                    w.add_scalar(f"{prefix}/{name}/layer{layer}", value, step)
        for name, value in row.router_stats.items():
            w.add_scalar(f"router/{name}", value, step)
        for name, per_layer in row.routing_per_expert.items():
            for layer, values in enumerate(per_layer, 1):
                _expert_histogram(w, f"experts/{name}/layer{layer}", values, step)
        w.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _expert_histogram(writer, tag: str, values: list[float], step: int) -> None:
    """Expert i's value as bucket (i - 0.5, i + 0.5]'s count; a plain histogram if any is negative (biases)."""
    if any(v < 0 for v in values):
        import numpy as np

        writer.add_histogram(tag, np.asarray(values, dtype=np.float64), step)
        return
    writer.add_histogram_raw(
        tag, min=0.0, max=float(len(values) - 1), num=float(sum(values)),
        sum=float(sum(i * v for i, v in enumerate(values))),
        sum_squares=float(sum(i * i * v for i, v in enumerate(values))),
        bucket_limits=[i + 0.5 for i in range(len(values))], bucket_counts=[float(v) for v in values], global_step=step,
    )


def tensorboard_dir(run_root: Path, configured: str | None) -> Path:
    """Where a run writes its events: ``logging.tensorboard_dir`` or ``<run dir>/tensorboard``."""
    return Path(configured) if configured else run_root / "tensorboard"


def check_tensorboard(run_root: Path, configured: str | None) -> None:
    """Refuse up front an unwritable TensorBoard log (package missing, directory a file or not writable): a
    ReproError naming the package or the path."""
    _require_tensorboard()
    target = tensorboard_dir(run_root, configured)
    ancestor = next(p for p in (target, *target.parents) if p.exists())  # the nearest existing one
    if not ancestor.is_dir():
        raise ReproError(f"{target}: cannot make the TensorBoard directory: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ReproError(f"{target}: cannot make the TensorBoard directory: {ancestor} is not writable")

