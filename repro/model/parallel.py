"""torch.distributed + megatron-core ``parallel_state`` set-up, for one process or under ``torchrun``.

Usage (the training loop, tests, the lm-eval bridge)::

    from repro.model.parallel import init_distributed, destroy_distributed
    info = init_distributed(tp=1, ep=1, seed=1234)   # gloo on CPU, nccl on GPU
    ...
    destroy_distributed()

Signatures (kept stable):

- ``init_distributed(tp: int = 1, ep: int = 1, seed: int = 1234, backend: str | None = None) -> ParallelInfo``
- ``destroy_distributed() -> None``
- ``is_initialized() -> bool``

Under ``torchrun`` the rank and world size come from the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``). Without them a one-process group is created on an
in-process store (no port is opened, so concurrent test runs on one machine cannot collide).

On CPU it applies :func:`repro.model.cpu_shims.apply_cpu_shims` and seeds megatron's RNG tracker in its
CPU form; on GPU it selects the local device and seeds the regular CUDA tracker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from repro.model.cpu_shims import apply_cpu_shims, cuda_available, seed_model_parallel_rng


@dataclass(frozen=True)
class ParallelInfo:
    """What :func:`init_distributed` set up.

    Args:
        rank: global rank.
        world_size: number of processes.
        local_rank: rank on this machine (the GPU index on GPU machines).
        tp: tensor-model-parallel size.
        ep: expert-model-parallel size.
        dp: data-parallel size (``world_size / tp``; megatron folds EP into DP for the dense part).
        backend: ``"gloo"`` or ``"nccl"``.
        device: the device this process computes on.
    """

    rank: int
    world_size: int
    local_rank: int
    tp: int
    ep: int
    dp: int
    backend: str
    device: torch.device


# Whether this module created the default process group (so destroy_distributed only tears down what
# init_distributed built). Process-wide by nature: torch.distributed's default group is process-wide too.
_OWNS_PROCESS_GROUP = False


def is_initialized() -> bool:
    """Whether torch.distributed and megatron's model-parallel state are both initialised."""
    from megatron.core import parallel_state

    return dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()


def init_distributed(tp: int = 1, ep: int = 1, seed: int = 1234, backend: str | None = None) -> ParallelInfo:
    """Initialise torch.distributed and megatron-core's parallel state; idempotent for the same sizes.

    Args:
        tp: tensor-model-parallel size (must divide the world size).
        ep: expert-model-parallel size (``tp * ep`` must divide the world size; the number of experts
            must be a multiple of it, which megatron checks when the model is built).
        seed: seeds torch and megatron's model-parallel RNG tracker.
        backend: ``"gloo"``/``"nccl"``; default gloo without CUDA, nccl with it.

    Returns:
        A :class:`ParallelInfo`.

    Raises:
        ValueError: sizes that do not divide the world size, or a different TP/EP than an existing
            initialisation (call :func:`destroy_distributed` first).
    """
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state

    on_gpu = cuda_available()
    if not on_gpu:
        apply_cpu_shims()
    backend = backend or ("nccl" if on_gpu else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    if not dist.is_initialized():
        if on_gpu:
            torch.cuda.set_device(local_rank)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, init_method="env://")
        else:
            # One process: an in-process store, so no port is needed and parallel runs cannot clash.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        _OWNS_PROCESS_GROUP = True
    world_size = dist.get_world_size()
    # megatron's expert grid is EP x expert-TP (= TP by default), so tp * ep must divide the world.
    if world_size % (tp * ep) != 0:
        raise ValueError(f"tp={tp}, ep={ep} do not divide the world size {world_size}")

    if parallel_state.model_parallel_is_initialized():
        have_tp = parallel_state.get_tensor_model_parallel_world_size()
        have_ep = parallel_state.get_expert_model_parallel_world_size()
        if (have_tp, have_ep) != (tp, ep):
            raise ValueError(
                f"megatron parallel state already initialised with tp={have_tp}, ep={have_ep}; "
                f"call destroy_distributed() before asking for tp={tp}, ep={ep}"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            create_gloo_process_groups=(backend == "gloo"),
        )
    seed_model_parallel_rng(seed)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=local_rank,
        tp=tp,
        ep=ep,
        dp=world_size // tp,
        backend=dist.get_backend(),
        device=device,
    )


def destroy_distributed() -> None:
    """Tear down megatron's parallel state, and the process group if :func:`init_distributed` made it."""
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_PROCESS_GROUP = False
