"""Checkpoints that hold everything a bit-identical resume needs, written atomically, one file per rank.

Layout (``torch.save`` per rank, not megatron's ``dist_checkpointing``: the suite's runs are small enough,
and a plain layout needs no sharded-tensor metadata to read back)::

    OUT/checkpoints/
        step_0000100/
            meta.json           step, consumed samples, layout, experiment config, the rank files
            rank_00000.pt       this rank's model state (router buffers included), optimizer state, LR
            rank_00001.pt       scheduler state, RNG states (python, numpy, torch CPU/CUDA, megatron's
            ...                 CUDA RNG tracker), step, consumed samples
        latest                  the name of the newest complete checkpoint directory (a convenience:
                                the newest directory with a meta.json is the truth)

Atomicity: every rank writes its file into ``.step_0000100.tmp/`` (each file via a temporary name and a
rename), all ranks meet at a barrier, then rank 0 writes ``meta.json`` and renames the directory to
``step_0000100``. A checkpoint directory therefore exists only when it is complete; a run killed while
writing leaves a ``.tmp`` directory that the next write removes. The file system must be shared by the
ranks (one machine, or a shared mount).

Model state in the per-rank files keeps megatron's *local* expert numbering. Resuming needs the same
layout (checked). :func:`load_model_weights` reads the weights of a checkpoint of *any* DP/EP layout
into a model of another (e.g. a one-process checkpoint into an EP=2 run): it renumbers experts
``local_experts.i`` of EP rank ``r`` to the global ``r * E_local + i`` and back.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from repro.errors import ReproError
from repro.io_utils import atomic_path, write_json_atomic
from repro.training.distributed import Parallel, barrier

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step_(\d{7,})$")
# megatron's SequentialMLP names experts ``...experts.local_experts.<i>.``; TEGroupedMLP ``...weight<i>``.
_SEQUENTIAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``meta.json`` of one checkpoint says.

    Args:
        path: the checkpoint directory.
        step: completed optimizer steps.
        consumed_samples: training samples consumed by all ranks together.
        layout: ``{"world_size", "dp", "tp", "ep"}`` of the run that wrote it.
        experiment: the experiment config (:meth:`Experiment.to_dict`).
        files: per-rank file names, indexed by global rank.
    """

    path: Path
    step: int
    consumed_samples: int
    layout: dict[str, int]
    experiment: dict[str, Any]
    files: tuple[str, ...]


def step_dir_name(step: int) -> str:
    """``step_0000100`` for step 100 (zero-padded so names sort by step)."""
    return f"step_{step:07d}"


def rank_file_name(rank: int) -> str:
    """``rank_00003.pt`` for global rank 3."""
    return f"rank_{rank:05d}.pt"


# -------------------------------------------------------------------------------------------- RNG
def capture_rng_state() -> dict[str, Any]:
    """Every RNG state a training step may draw from (python, numpy, torch CPU, CUDA, megatron tracker)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        if tracker.is_initialized():
            state["megatron_tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        if "megatron_tracker" in state:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            get_cuda_rng_tracker().set_states(state["megatron_tracker"])


# ------------------------------------------------------------------------------------------ saving
def save_checkpoint(
    checkpoints_dir: str | os.PathLike,
    *,
    step: int,
    consumed_samples: int,
    parallel: Parallel,
    experiment: dict[str, Any],
    model: nn.Module,
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write one checkpoint (collective: every rank calls it).

    Args:
        checkpoints_dir: ``OUT/checkpoints``.
        step: completed optimizer steps.
        consumed_samples: samples consumed by all ranks together.
        parallel: the layout (rank, sizes).
        experiment: the experiment config dict (stored in ``meta.json``).
        model: the local model (its ``state_dict`` includes the routers' buffers).
        optimizer_state: the optimizer's state (already gathered where the optimizer needs it).
        scheduler_state: the LR scheduler's state.
        extra: more per-rank entries (e.g. the run's running statistics).

    Returns:
        The checkpoint directory.
    """
    root = Path(checkpoints_dir)
    final = root / step_dir_name(step)
    tmp = root / f".{final.name}.tmp"
    if parallel.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a run killed while writing
        tmp.mkdir(parents=True)
    barrier()
    payload = {
        "format": FORMAT_VERSION,
        "step": step,
        "consumed_samples": consumed_samples,
        "rank": parallel.rank,
        "ep_rank": parallel.ep_rank,
        "ep_size": parallel.ep_size,
        "model": model.state_dict(),
        "optimizer": optimizer_state,
        "scheduler": scheduler_state,
        "rng": capture_rng_state(),
        "extra": extra or {},
    }
    target = tmp / rank_file_name(parallel.rank)
    with atomic_path(target) as part:
        torch.save(payload, part)
    barrier()
    if parallel.is_main:
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            "consumed_samples": consumed_samples,
            "layout": parallel.layout(),
            "experiment": experiment,
            "files": [rank_file_name(r) for r in range(parallel.world_size)],
        }
        write_json_atomic(tmp / "meta.json", meta)
        if final.exists():
            shutil.rmtree(final)  # a re-run of the same step after a resume from an earlier one
        os.replace(tmp, final)
        with atomic_path(root / "latest") as part:
            part.write_text(final.name + "\n")
    barrier()
    return final


# ----------------------------------------------------------------------------------------- reading
def read_checkpoint_info(path: str | os.PathLike) -> CheckpointInfo:
    """Read and check ``meta.json`` of a checkpoint directory.

    Args:
        path: the checkpoint directory.

    Returns:
        Its :class:`CheckpointInfo`.

    Raises:
        ReproError: missing or unreadable ``meta.json``, or a missing rank file (naming the path).
    """
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ReproError(f"{path}: not a checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
        info = CheckpointInfo(
            path=path,
            step=int(meta["step"]),
            consumed_samples=int(meta["consumed_samples"]),
            layout={k: int(v) for k, v in meta["layout"].items()},
            experiment=dict(meta["experiment"]),
            files=tuple(meta["files"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ReproError(f"{meta_path}: corrupt checkpoint metadata ({type(exc).__name__}: {exc})") from None
    for name in info.files:
        if not (path / name).is_file():
            raise ReproError(f"{path / name}: checkpoint file missing")
    return info


def find_latest_checkpoint(checkpoints_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory under ``checkpoints_dir`` (None if there is none).

    Complete means it has a ``meta.json`` (written last, just before the directory got its final name).
    """
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return None
    steps = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / "meta.json").is_file():
            steps.append((int(match.group(1)), child))
    return max(steps)[1] if steps else None


def load_rank_payload(info: CheckpointInfo, rank: int) -> dict[str, Any]:
    """``torch.load`` one rank's file of a checkpoint.

    Args:
        info: the checkpoint.
        rank: which rank's file.

    Returns:
        The payload written by :func:`save_checkpoint`.

    Raises:
        ReproError: unreadable or corrupt file (naming the path).
    """
    path = info.path / info.files[rank]
    try:
        # weights_only=False: the payload holds RNG states (python tuples, numpy arrays) and the config.
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is "corrupt" to the user
        raise ReproError(f"{path}: corrupt checkpoint file ({type(exc).__name__}: {exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION or "model" not in payload:
        raise ReproError(f"{path}: not a checkpoint file of format {FORMAT_VERSION}")
    return payload


def check_same_layout(info: CheckpointInfo, parallel: Parallel) -> None:
    """Raise :class:`ReproError` unless the checkpoint was written by the same process layout."""
    if info.layout != parallel.layout():
        raise ReproError(
            f"{info.path}: written by layout {info.layout}, this run is {parallel.layout()}; resume with the "
            "same torchrun size, tp and ep (or start a new run with --set init_from=<checkpoint>)"
        )


# ----------------------------------------------------------------------- weights across layouts
def _to_global_key(key: str, ep_rank: int, num_local: int) -> str:
    def seq(m: re.Match) -> str:
        return f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3)}"

    def grouped(m: re.Match) -> str:
        return f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}"

    return _GROUPED_EXPERT.sub(grouped, _SEQUENTIAL_EXPERT.sub(seq, key))


def _num_local_experts(keys) -> int:
    found: set[int] = set()
    for key in keys:
        for pattern in (_SEQUENTIAL_EXPERT, _GROUPED_EXPERT):
            m = pattern.search(key)
            if m:
                found.add(int(m.group(2)))
    return max(found) + 1 if found else 0


def global_model_state(payloads: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Merge per-rank model states into one state with global expert numbers.

    Args:
        payloads: the rank payloads of one checkpoint (any subset covering every EP rank).

    Returns:
        ``{key: tensor}`` as a single process holding every expert would name it.
    """
    merged: dict[str, torch.Tensor] = {}
    for payload in payloads:
        state = payload["model"]
        num_local = _num_local_experts(state)
        for key, value in state.items():
            merged.setdefault(_to_global_key(key, int(payload.get("ep_rank", 0)), num_local), value)
    return merged


def load_model_weights(path: str | os.PathLike, model: nn.Module, parallel: Parallel) -> CheckpointInfo:
    """Initialise ``model`` from a checkpoint written with any DP/EP layout (weights and buffers only).

    Args:
        path: a checkpoint directory, or a run's ``checkpoints`` directory / output directory (its newest
            checkpoint is taken).
        model: the local model of this run.
        parallel: this run's layout.

    Returns:
        The checkpoint read.

    Raises:
        ReproError: no checkpoint there, corrupt files, or weights that do not fit the model.
    """
    path = Path(path)
    if not (path / "meta.json").is_file():
        for candidate in (path, path / "checkpoints"):
            latest = find_latest_checkpoint(candidate)
            if latest is not None:
                path = latest
                break
    info = read_checkpoint_info(path)
    if info.layout == parallel.layout():
        state = load_rank_payload(info, parallel.rank)["model"]
        _load_strict(model, state, path)
    else:
        state_global = global_model_state([load_rank_payload(info, r) for r in range(len(info.files))])
        load_global_state(model, state_global, parallel, str(path))
    return info


def load_global_state(
    model: nn.Module, state_global: dict[str, torch.Tensor], parallel: Parallel, source: str
) -> None:
    """Load the part of a global-numbered model state (:func:`global_model_state`) this rank holds.

    Args:
        model: the local model (experts ``ep_rank * E_local ...`` of every layer).
        state_global: the state with global expert numbers.
        parallel: this rank's layout (its EP rank picks the experts).
        source: where the state comes from, for error messages.

    Raises:
        ReproError: the state lacks weights of the model or does not fit it.
    """
    local_keys = list(model.state_dict().keys())
    num_local = _num_local_experts(local_keys)
    state = {}
    missing = []
    for key in local_keys:
        gkey = _to_global_key(key, parallel.ep_rank, num_local)
        if gkey in state_global:
            state[key] = state_global[gkey]
        else:
            missing.append(gkey)
    if missing:
        raise ReproError(f"{source}: lacks {len(missing)} weight(s) of this model, e.g. {missing[0]}")
    _load_strict(model, state, source)


def _load_strict(model: nn.Module, state: dict[str, torch.Tensor], source) -> None:
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ReproError(f"{source}: checkpoint weights do not fit this model ({first})") from None
