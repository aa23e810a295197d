"""Linear warmup then cosine decay to a floor: the schedule of both papers (megatron's ``cosine`` style).

After ``step`` completed steps the next uses ``lr_at(step + 1)``: the first trains at ``lr / warmup_steps``
(not a wasted 0), the last warmup step at the peak, the last step at ``min_lr``, as megatron counts
(``OptimizerParamScheduler.step`` increments first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosineSchedule:
    """LR as a pure function of the step: linear warmup to ``peak_lr``, cosine to ``min_lr`` at ``total_steps``."""

    peak_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"warmup_steps must be in [0, {self.total_steps}], got {self.warmup_steps}")
        if not 0.0 <= self.min_lr <= self.peak_lr:
            raise ValueError(f"need 0 <= min_lr <= peak_lr, got {self.min_lr}, {self.peak_lr}")

    def lr_at(self, step: int) -> float:
        """LR of 1-based ``step``: ``peak * step / warmup``, then ``min + (peak - min) * (1 + cos(pi * p)) / 2``,
        ``p = (step - warmup) / (total - warmup)`` clamped to [0, 1]."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        if decay_steps <= 0:
            return self.peak_lr if step <= self.total_steps else self.min_lr
        progress = min(max((step - self.warmup_steps) / decay_steps, 0.0), 1.0)
        return self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRScheduler:
    """Applies a :class:`WarmupCosineSchedule` to ``param_groups``; state: steps taken. megatron's groups get
    ``lr * lr_mult`` and ``weight_decay * wd_mult`` (as ``OptimizerParamScheduler``); torch's keep their decay."""

    def __init__(self, optimizer, schedule: WarmupCosineSchedule, weight_decay: float = 0.0) -> None:
        self.optimizer, self.schedule, self.weight_decay, self.num_steps = optimizer, schedule, weight_decay, 0

    def apply(self) -> float:
        """Set the LR (and megatron groups' weight decay) for the next optimizer step and return the LR."""
        lr = self.schedule.lr_at(self.num_steps + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            if "wd_mult" in group:
                group["weight_decay"] = self.weight_decay * group["wd_mult"]
        return lr

    def step(self) -> None:  # after optimizer.step()
        self.num_steps += 1

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "schedule": self.schedule.__dict__.copy()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step count (the saved schedule may differ: the config decides)."""
        self.num_steps = int(state["num_steps"])

