"""A cluster's time limit is not a crash: SIGTERM or SIGUSR1 ends the run after the current step, with a checkpoint.

SLURM sends SIGTERM to every process of a job step when the job reaches its time limit or is preempted (and
SIGKILL ``KillWait`` seconds later); ``--signal=...@SECONDS`` asks for a signal earlier (the batch script that
``python -m repro launch --slurm`` writes does, see :mod:`repro.launch`). As Megatron-LM's exit-signal
handler (``megatron/training/dist_signal_handler.py``), the trainer then:

1. records the signal (:class:`StopRequest`'s handler does nothing else, so the step in progress finishes);
2. after each step, agrees with every rank on whether any of them got one: a MAX all-reduce of the signal
   number over all processes, so all ranks stop after the same step even when only some were signalled;
3. writes the checkpoint of that step (unless the checkpoint interval just wrote it), prints one line saying
   how to resume (rank 0), and ends the run: ``train()`` raises :class:`RunStopped` and ``python -m repro
   train`` exits with :data:`EXIT_STOPPED`.

The all-reduce costs one scalar per step; a run without torch.distributed (or with one process) reads its
own flag.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from repro.errors import ReproError
from repro.training.components import Checkpointer
from repro.training.distributed import barrier

if TYPE_CHECKING:
    from repro.training.components import TrainerState

#: Exit status of ``python -m repro train`` when a signal stopped the run after writing its checkpoint:
#: sysexits.h's EX_TEMPFAIL ("temporary failure; the user is invited to retry"). 0 is a finished run, 1 an
#: error, 2 a usage error; 143 (128 + SIGTERM) is a process killed by the signal, i.e. without a checkpoint.
EXIT_STOPPED = 75
class RunStopped(ReproError):
    """A signal stopped the run after a step, whose checkpoint is written: resume it (``train --resume``).

    An error to callers that expect a finished run (the mini comparison, the ablation), so nothing evaluates or
    records the unfinished run; ``python -m repro train`` turns it into :data:`EXIT_STOPPED`.

    Attributes:
        step: the step reached and checkpointed.
        signal: the signal's name (``SIGTERM``, ``SIGUSR1``).
    """

    def __init__(self, message: str, step: int, signal: str) -> None:
        super().__init__(message)
        self.step = step
        self.signal = signal


#: The signals that stop a run cleanly: SLURM's at the time limit, and the usual ``--signal=USR1@...``.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Records a stop signal and tells, after each step, whether any rank got one."""

    def __init__(self) -> None:
        self.signum = 0

    def _record(self, signum: int, frame) -> None:
        self.signum = self.signum or signum  # the first signal names the stop

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle :data:`STOP_SIGNALS` inside the block, restoring the previous handlers after it.

        Python lets only the main thread install handlers; elsewhere (a run started from a worker thread)
        the signals keep their previous behaviour.
        """
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
        """The signal any rank received so far (the largest number), 0 for none; collective over all processes.

        Args:
            device: where the collective's tensor lives (the model's device: nccl moves CUDA tensors).
        """
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, and so on."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def resume_line(run_name: str, signum: int, step: int, checkpoint: str, run_dir: str) -> str:
    """The one line a stopped run prints (rank 0)."""
    return (
        f"{run_name}: stopped by {signal_name(signum)} after step {step}, checkpoint {checkpoint}; resume with: "
        f"python -m repro train --out {shlex.quote(run_dir)} --resume"
    )


def stop_run(trainer: TrainerState, signum: int) -> str:
    """End a run on a signal: the checkpoint of the step just completed (unless the interval just wrote it), the
    resume line on rank 0, and a barrier so no rank leaves before rank 0 has said it (collective).

    Returns:
        The signal's name.
    """
    import sys

    checkpointer = next(c for c in trainer.components if isinstance(c, Checkpointer))
    path = checkpointer.ensure_saved(trainer)
    if trainer.parallel.is_main:
        line = resume_line(trainer.config.name, signum, trainer.step, str(path), str(trainer.paths.root))
        print(line, file=sys.stderr, flush=True)
    barrier()
    return signal_name(signum)


__all__ = ["EXIT_STOPPED", "STOP_SIGNALS", "RunStopped", "StopRequest", "resume_line", "signal_name", "stop_run"]
