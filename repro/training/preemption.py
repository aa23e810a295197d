"""SIGTERM, SIGUSR1 or Ctrl-C (twice: at once, without a checkpoint) end a run after the current step, with its
checkpoint (docs/failures.md; as Megatron-LM's exit-signal handler): :class:`StopRequest` records the signal, the
ranks agree after each step so that all stop after the same one, and :func:`stop_run` checkpoints.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch.distributed as dist

from repro.errors import ReproError
from repro.training.checkpoint import all_ranks_reduce
from repro.training.components import Checkpointer
from repro.training.distributed import barrier

if TYPE_CHECKING:
    from repro.training.components import TrainerState

#: Exit status after a signal stopped the run with its checkpoint: EX_TEMPFAIL (a killed one exits 143).
EXIT_STOPPED = 75
#: Exit status after Ctrl-C stopped the run with its checkpoint: the shell's 128 + SIGINT, as for any program.
EXIT_INTERRUPTED = 130


class RunStopped(ReproError):
    """A signal stopped the run after ``step`` (checkpointed); an error so nothing records the unfinished run."""

    def __init__(self, message: str, step: int, signal: str) -> None:
        super().__init__(message)
        self.step = step
        self.signal = signal


#: The signals that stop a run cleanly: SLURM's at the time limit, the usual ``--signal=USR1@...``, and Ctrl-C.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Records a stop signal and tells, after each step, whether any rank got one.

    Args:
        on_ctrl_c: what the first Ctrl-C prints (the interleaved runs stop after a round, without a checkpoint).
    """

    def __init__(self, on_ctrl_c: str = "Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again: at once, "
                                        "without one)") -> None:
        self.signum = 0
        self.on_ctrl_c = on_ctrl_c

    def _record(self, signum: int, frame) -> None:  # nothing else, so the step in progress finishes
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: the user will not wait for the step and its checkpoint
        self.signum = self.signum or signum  # the first signal names the stop
        if signum == signal.SIGINT:
            print(self.on_ctrl_c, file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle :data:`STOP_SIGNALS` in the block (main thread only, as Python requires), then restore."""
        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS} if main else {}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def agreed(self) -> int:
        """Largest signal any rank got so far, 0 for none (collective)."""
        return all_ranks_reduce(self.signum, dist.ReduceOp.MAX)


def stop_run(trainer: TrainerState, signum: int) -> str:
    """End a run on a signal (collective): checkpoint, resume line on rank 0, barrier; returns the signal name."""
    name = {s.value: s.name for s in signal.Signals}.get(signum, f"signal {signum}")
    checkpointer = next(c for c in trainer.components if isinstance(c, Checkpointer))
    path = checkpointer.ensure_saved(trainer)
    if trainer.parallel.is_main:
        print(f"{trainer.config.name}: stopped by {name} after step {trainer.step}, checkpoint {path}; resume with: "
              f"python -m repro train --out {shlex.quote(str(trainer.paths.root))} --resume", file=sys.stderr,
              flush=True)
    barrier()
    return name
