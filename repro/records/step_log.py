"""The training log: one :class:`LogRow` per optimizer step in ``log.jsonl``, one writer, one reader
(:func:`read_rows` checks every row and names the file and line of a bad one), and the run's summary.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from repro.errors import ReproError
from repro.io_utils import atomic_path
from repro.schema import from_json, to_json

if TYPE_CHECKING:
    from repro.config import RunConfig

LOG_FILE = "log.jsonl"


@dataclass(frozen=True)
class LogRow:
    """One optimizer step (``step``: 1-based).

    Args:
        loss, lm_loss: ``lm_loss`` plus aux losses (the objective); mean next-token cross-entropy (all ranks).
        aux_losses: ``{name: value summed over layers}``, coefficients applied.
        iter_time_s: wall time of the step's timed part (:mod:`repro.training.trainer`).
        consumed_samples, peak_memory_bytes: samples consumed by all ranks so far; peak CUDA memory (CPU: RSS).
        routing: ``{metric: [value per MoE layer]}`` (mean over micro-batches and DP ranks); empty if dense.
        routing_per_expert, router_stats: ``{metric: [[per expert] per layer]}``; schedule statistics.
        metrics_collected: whether routers computed diagnostics (in ``iter_time_s``; else the above are empty).
        device_time_s: CUDA only: the timed part's device span between CUDA events (no host waits); else None.
    """

    step: int
    loss: float
    lm_loss: float
    lr: float
    grad_norm: float
    iter_time_s: float
    tokens_per_s: float
    consumed_samples: int
    peak_memory_bytes: int
    aux_losses: dict[str, Any] = field(default_factory=dict)
    aux_losses_per_layer: dict[str, Any] = field(default_factory=dict)
    routing: dict[str, Any] = field(default_factory=dict)
    routing_per_expert: dict[str, Any] = field(default_factory=dict)
    router_stats: dict[str, Any] = field(default_factory=dict)
    val_loss: float | None = None
    metrics_collected: bool = True
    device_time_s: float | None = None

    def layer_mean(self, metric: str) -> float | None:
        """Mean of a routing metric over MoE layers (None if absent)."""
        values = self.routing.get(metric) or []
        return sum(values) / len(values) if values else None


def write_row(file: IO[str], row: LogRow) -> None:
    """Append one row to an open ``log.jsonl`` and flush it."""
    data = to_json(row)
    for name in ("val_loss", "device_time_s"):  # absent rather than null
        if data[name] is None:
            del data[name]
    file.write(json.dumps(data) + "\n")
    file.flush()


def timed_rows(rows: Sequence[LogRow]) -> Sequence[LogRow]:
    """Rows that did not collect routing metrics (pure training time), or all rows if every step did."""
    clean = [r for r in rows if not r.metrics_collected]
    return clean if clean else rows


def read_rows(path: str | os.PathLike) -> list[LogRow]:
    """The rows of a ``log.jsonl`` (or a run directory's), in file order."""
    path = Path(path)
    if path.is_dir():
        path = path / LOG_FILE
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ReproError(f"{path}: cannot read the training log: {exc.strerror or exc}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReproError(f"{path}:{number}: not JSON: {exc.msg}") from None
        rows.append(from_json(LogRow, data, f"{path}:{number}"))
    return rows


def truncate_rows(path: Path, last_step: int) -> None:
    """Keep rows of steps <= ``last_step`` (a killed run may have logged past its checkpoint), up to a cut line."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            break
        if step <= last_step:
            kept.append(line)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))


def summarize(rows: list[LogRow], config: RunConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """The run's summary from its rows, then ``extra``; throughput uses :func:`timed_rows` after the first."""
    timed = timed_rows(rows[1:] if len(rows) > 1 else rows)
    last = rows[-1] if rows else None
    vals = [r.val_loss for r in rows if r.val_loss is not None]
    tail = rows[-10:]
    return {
        "experiment": config.name,
        "router": config.router.name or "dense",
        "flavour": config.model.flavour,
        "steps": last.step if last else 0,
        "final_loss": last.loss if last else None,
        "final_lm_loss": last.lm_loss if last else None,
        "final_loss_mean10": statistics.fmean(r.loss for r in tail) if tail else None,
        "final_val_loss": vals[-1] if vals else None,
        "tokens": (last.consumed_samples if last else 0) * int(extra.get("seq_length", 0)),
        "tokens_per_s_mean": statistics.fmean(r.tokens_per_s for r in timed) if timed else None,
        "tokens_per_s_median": statistics.median(r.tokens_per_s for r in timed) if timed else None,
        "iter_time_s_mean": statistics.fmean(r.iter_time_s for r in timed) if timed else None,
        "active_experts_final": last.routing.get("active_experts") if last else None,
        "simpson_final": last.routing.get("simpson") if last else None,
        **extra,
    }
