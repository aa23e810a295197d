"""A cluster's time limit is not a crash: SIGTERM or SIGUSR1 ends the run after the current step, with a
checkpoint (docs/failures.md); so does Ctrl-C (SIGINT; a second Ctrl-C stops at once, without one). As Megatron-LM's exit-signal handler, the trainer records the signal
(:class:`StopRequest`), agrees with every rank after each step on whether any got one, so all stop after the
same step, then writes that step's checkpoint, says how to resume and raises :class:`RunStopped`.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from repro.errors import ReproError
from repro.training.checkpoint import all_ranks_reduce
from repro.training.components import Checkpointer
from repro.training.distributed import barrier

if TYPE_CHECKING:
    from repro.training.components import TrainerState

#: Exit status of ``python -m repro train`` when a signal stopped the run after writing its checkpoint:
#: sysexits.h's EX_TEMPFAIL (a process killed by the signal, without a checkpoint, exits 143 = 128 + SIGTERM).
EXIT_STOPPED = 75
#: Exit status after Ctrl-C stopped the run with its checkpoint: the shell's 128 + SIGINT, as for any program.
EXIT_INTERRUPTED = 130


class RunStopped(ReproError):
    """A signal (its name in ``signal``) stopped the run after ``step``, whose checkpoint is written: an error
    to callers that expect a finished run, so nothing evaluates or records the unfinished run."""

    def __init__(self, message: str, step: int, signal: str) -> None:
        super().__init__(message)
        self.step = step
        self.signal = signal


#: The signals that stop a run cleanly: SLURM's at the time limit, the usual ``--signal=USR1@...``, and Ctrl-C.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Records a stop signal and tells, after each step, whether any rank got one."""

    def __init__(self) -> None:
        self.signum = 0

    def _record(self, signum: int, frame) -> None:  # nothing else, so the step in progress finishes
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: the user will not wait for the step and its checkpoint
        self.signum = self.signum or signum  # the first signal names the stop
        if signum == signal.SIGINT:
            print("Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again: at once, without one)",
                  file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle :data:`STOP_SIGNALS` inside the block (main thread only: Python lets no other thread install
        handlers), restoring the previous handlers after it."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def agreed(self, device: torch.device) -> int:
        """The signal any rank received so far (the largest number), 0 for none; collective over all processes
        (``device``: the model's, where nccl's tensor lives)."""
        return all_ranks_reduce(self.signum, dist.ReduceOp.MAX, device)


def stop_run(trainer: TrainerState, signum: int) -> str:
    """End a run on a signal (collective): the checkpoint of the step just completed (unless the interval just
    wrote it), the resume line on rank 0, and a barrier so no rank leaves before rank 0 has said it; return
    the signal's name."""
    name = {s.value: s.name for s in signal.Signals}.get(signum, f"signal {signum}")
    checkpointer = next(c for c in trainer.components if isinstance(c, Checkpointer))
    path = checkpointer.ensure_saved(trainer)
    if trainer.parallel.is_main:
        print(
            f"{trainer.config.name}: stopped by {name} after step {trainer.step}, checkpoint {path}; resume with: "
            f"python -m repro train --out {shlex.quote(str(trainer.paths.root))} --resume",
            file=sys.stderr,
            flush=True,
        )
    barrier()
    return name
