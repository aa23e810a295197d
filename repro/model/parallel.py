"""torch.distributed + megatron-core ``parallel_state`` set-up, for one process or under ``torchrun``.

Ranks come from torchrun's or SLURM's variables (:func:`rank_environment`, docs/clusters.md); a multi-task
launch whose rank a process cannot tell is refused rather than trained as a one-process world.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from repro.errors import ReproError
from repro.model.cpu_shims import apply_cpu_shims, seed_model_parallel_rng

#: How MPI launchers (Open MPI, MPICH / Intel MPI / PMI-2, PMIx, MVAPICH2) give the number of processes.
MPI_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class ParallelInfo:
    """What :func:`init_distributed` set up."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


# Whether init_distributed created the default process group (destroy_distributed tears down only that).
_OWNS_PROCESS_GROUP = False


def scontrol_hostnames(nodelist: str) -> list[str]:
    """Expand a SLURM node list (``gpu[01-04]``) with ``scontrol show hostnames`` (ReproError if it fails)."""
    if shutil.which("scontrol") is None:
        raise ReproError(f"cannot find the first node of '{nodelist}': scontrol is not on PATH; export MASTER_ADDR")
    proc = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not proc.stdout.split():
        raise ReproError(f"scontrol show hostnames '{nodelist}' failed: {proc.stderr.strip()}; export MASTER_ADDR")
    return proc.stdout.split()


def _int_var(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ReproError(f"environment variable {name}={value!r} is not an integer") from None


def rank_environment(environ: Mapping[str, str],
                     hostnames: Callable[[str], list[str]] = scontrol_hostnames) -> dict[str, str]:
    """torch.distributed variables to add to ``environ`` (none under torchrun or alone). A task of an srun step of
    N > 1 (``SLURM_STEP_NUM_TASKS``) gets ``RANK``/``LOCAL_RANK`` from ``SLURM_PROCID``/``SLURM_LOCALID``,
    ``WORLD_SIZE=N``, and unless set ``MASTER_ADDR`` (first node) and ``MASTER_PORT`` (15000 + last four job-id
    digits, as Lightning's ``SLURMEnvironment.main_port``).

    Raises:
        ReproError: only one of ``RANK``/``WORLD_SIZE``; ``SLURM_NTASKS`` > 1 outside an srun step; no usable
            ``SLURM_PROCID``/``SLURM_LOCALID``; MPI size > 1; node list not expandable without ``MASTER_ADDR``.
    """
    if ("RANK" in environ) != ("WORLD_SIZE" in environ):
        have, missing = ("RANK", "WORLD_SIZE") if "RANK" in environ else ("WORLD_SIZE", "RANK")
        raise ReproError(f"{have} is set but {missing} is not: launch with torchrun, or set both")
    if "RANK" in environ:
        return {}
    ntasks = _int_var(environ, "SLURM_NTASKS")
    step_tasks = _int_var(environ, "SLURM_STEP_NUM_TASKS")
    if step_tasks is None and (ntasks or 1) > 1:
        raise ReproError(f"SLURM_NTASKS={ntasks} but this process was not started by srun and has no RANK/WORLD_SIZE: "
                         "run it under srun (one task per GPU) or srun torchrun (python -m repro launch --slurm)")
    if step_tasks is not None and step_tasks > 1:
        rank, local = _int_var(environ, "SLURM_PROCID"), _int_var(environ, "SLURM_LOCALID")
        if rank is None or local is None or not 0 <= rank < step_tasks:
            raise ReproError(f"srun step of {step_tasks} tasks with SLURM_PROCID={environ.get('SLURM_PROCID')}, "
                             f"SLURM_LOCALID={environ.get('SLURM_LOCALID')}: cannot tell this task's rank; "
                             "launch with torchrun")
        out = {"RANK": str(rank), "WORLD_SIZE": str(step_tasks), "LOCAL_RANK": str(local)}
        if "MASTER_ADDR" not in environ:
            nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
            if not nodelist:
                raise ReproError("srun step without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: export MASTER_ADDR")
            out["MASTER_ADDR"] = hostnames(nodelist)[0]
        if "MASTER_PORT" not in environ:
            job = environ.get("SLURM_JOB_ID", "")
            out["MASTER_PORT"] = str(15000 + int(job[-4:])) if job.isdigit() else "29500"
        return out
    for name in MPI_SIZE_VARIABLES:
        size = _int_var(environ, name)
        if size is not None and size > 1:
            raise ReproError(f"{name}={size}: started by an MPI launcher without RANK/WORLD_SIZE, so this "
                             "process cannot tell its rank; launch with torchrun (python -m repro launch)")
    return {}


def cuda_device_index(local_rank: int, device_count: int) -> int:
    """The local rank's GPU, or the only visible one (ReproError: more processes than GPUs on the node)."""
    if device_count == 1:
        return 0
    if not 0 <= local_rank < device_count:
        raise ReproError(f"local rank {local_rank} but {device_count} GPUs visible: more processes than GPUs on this node")
    return local_rank


def is_initialized() -> bool:
    from megatron.core import parallel_state

    return dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()


def init_distributed(tp: int = 1, ep: int = 1, seed: int = 1234) -> ParallelInfo:
    """Initialise torch.distributed and megatron's parallel state (idempotent; CPU shims or local GPU selected).

    Args:
        tp, ep: TP/EP sizes (``tp * ep`` must divide the world size; megatron checks ``E % ep`` at build).
        seed: seeds torch and megatron's model-parallel RNG tracker.

    Raises:
        ValueError: sizes not dividing the world, or TP/EP differing from an existing initialisation.
        ReproError: a multi-process launch whose rank cannot be told (:func:`rank_environment`).
    """
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state

    on_gpu = not apply_cpu_shims()  # patched only without CUDA
    backend = "nccl" if on_gpu else "gloo"
    if not dist.is_initialized():
        # srun-started tasks: export the ranks so the rest of the process sees what it would under torchrun.
        os.environ.update(rank_environment(os.environ))
        if on_gpu:
            torch.cuda.set_device(cuda_device_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, init_method="env://")
        else:
            # One process: an in-process store (no port, so concurrent runs cannot clash).
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        _OWNS_PROCESS_GROUP = True
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = dist.get_world_size()
    # megatron's expert grid is EP x expert-TP (= TP by default), so tp * ep must divide the world.
    if world_size % (tp * ep) != 0:
        raise ValueError(f"tp={tp}, ep={ep} do not divide the world size {world_size}")

    if parallel_state.model_parallel_is_initialized():
        have_tp = parallel_state.get_tensor_model_parallel_world_size()
        have_ep = parallel_state.get_expert_model_parallel_world_size()
        if (have_tp, have_ep) != (tp, ep):
            raise ValueError(f"megatron parallel state already initialised with tp={have_tp}, ep={have_ep}; "
                             f"call destroy_distributed() before asking for tp={tp}, ep={ep}")
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                 create_gloo_process_groups=(backend == "gloo"))
    seed_model_parallel_rng(seed)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return ParallelInfo(rank=dist.get_rank(), world_size=world_size, local_rank=local_rank,
                        backend=dist.get_backend(), device=device)


def destroy_distributed() -> None:
    """Tear down megatron's parallel state, and the process group if :func:`init_distributed` made it."""
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_PROCESS_GROUP = False
