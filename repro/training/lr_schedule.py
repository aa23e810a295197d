"""Linear warmup then cosine decay to a floor: the schedule of both papers (megatron's ``cosine`` style).

Step numbering: the optimizer step that follows ``step`` completed steps (``step = 0, 1, ...``) uses
``lr_at(step + 1)``. So the first step trains at ``lr / warmup_steps`` (not at 0, which would waste it),
the last warmup step reaches the peak, and the last step of the run reaches ``min_lr`` exactly. Megatron
counts the same way (``OptimizerParamScheduler.step`` increments before computing the LR).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosineSchedule:
    """The learning rate as a pure function of the step.

    Args:
        peak_lr: the LR at the end of warmup.
        min_lr: the floor the cosine decays to (and stays at after ``total_steps``).
        warmup_steps: linear warmup length (0: start at the peak).
        total_steps: the step at which the cosine reaches ``min_lr``.
    """

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
        """The learning rate of optimizer step number ``step`` (1-based: the first step is 1).

        Args:
            step: 1-based step (0 gives 0 during warmup, the value before any step).

        Returns:
            ``peak * step / warmup`` during warmup, then ``min + (peak - min) * (1 + cos(pi * p)) / 2`` with
            ``p = (step - warmup) / (total - warmup)`` clamped to [0, 1], so ``min_lr`` after ``total_steps``.
        """
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        if decay_steps <= 0:
            return self.peak_lr if step <= self.total_steps else self.min_lr
        progress = min(max((step - self.warmup_steps) / decay_steps, 0.0), 1.0)
        return self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRScheduler:
    """Applies a :class:`WarmupCosineSchedule` to an optimizer's parameter groups.

    Works with ``torch.optim`` optimizers and megatron-core's (both expose ``param_groups``). Its state is
    the number of steps taken. megatron's groups carry ``lr_mult`` and ``wd_mult`` (0 for biases and 1-D
    parameters) and leave it to the scheduler to set ``lr`` and ``weight_decay`` from them, as megatron's
    ``OptimizerParamScheduler`` does; groups without them (torch's) keep their own weight decay.

    Args:
        optimizer: the optimizer whose ``param_groups`` get the LR.
        schedule: the schedule.
        weight_decay: the base weight decay for groups with a ``wd_mult``.
    """

    def __init__(self, optimizer, schedule: WarmupCosineSchedule, weight_decay: float = 0.0) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.weight_decay = weight_decay
        self.num_steps = 0

    def apply(self) -> float:
        """Set the LR (and megatron groups' weight decay) for the next optimizer step (number
        ``num_steps + 1``) and return the LR."""
        lr = self.schedule.lr_at(self.num_steps + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            if "wd_mult" in group:
                group["weight_decay"] = self.weight_decay * group["wd_mult"]
        return lr

    def step(self) -> None:
        """Count one optimizer step (call after ``optimizer.step()``)."""
        self.num_steps += 1

    def state_dict(self) -> dict:
        """``{"num_steps", "schedule"}`` (the schedule for checking on load)."""
        return {"num_steps": self.num_steps, "schedule": self.schedule.__dict__.copy()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step count. A different saved schedule is allowed (it is the config's to decide)."""
        self.num_steps = int(state["num_steps"])

