"""Checkpoints that hold everything a bit-identical resume needs, written atomically, one file per rank,
loaded without running any code from them, and checked against what wrote them (docs/failures.md)::

    OUT/checkpoints/
        step_0000100/
            meta.json           format, step, consumed samples, layout, config, run identity, rank files + sha256
            rank_00000.pt       model (router buffers too), optimizer, scheduler, RNG, step, run identity
        latest                  newest complete checkpoint's name (convenience; the newest with meta.json rules)

Ranks write into ``.step_0000100.tmp/``, agree all succeeded, then rank 0 writes ``meta.json`` and renames:
a checkpoint directory exists only when complete (shared file system required). Model state keeps *local*
expert numbering, so resuming needs the same layout; :func:`load_model_weights` maps across DP/EP layouts
(expert ``i`` of EP rank ``r`` <-> ``r * E_local + i``). RNG states are stored as tensors and plain numbers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import random
import re
import shutil
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from repro.errors import ReproError
from repro.io_utils import atomic_path, error_from_os_error, os_error_message, write_synced
from repro.training.distributed import Parallel, all_reduce

FORMAT_VERSION = 2
STEP_DIR = re.compile(r"^step_(\d{7,})$")
INCOMPLETE_DIR = re.compile(r"^\.step_(\d{7,})\.tmp$")
# What a checkpoint directory (complete or not) may hold: only such a directory is ever removed or replaced.
_OWN_ENTRY = re.compile(r"^(meta\.json|rank_\d{5,}\.pt|rank_\d{5,}\.pt\.sha256|\..*\.tmp)$")
# megatron's SequentialMLP names experts ``...experts.local_experts.<i>.``; TEGroupedMLP ``...weight<i>``.
_SEQUENTIAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """``path``'s ``meta.json``: ``layout`` ``{"world_size", "dp", "tp", "ep"}``, ``experiment`` (config dict),
    ``files`` (rank files by global rank), ``sha256``, ``identity`` (:func:`run_identity`)."""

    path: Path
    step: int
    consumed_samples: int
    layout: dict[str, int]
    experiment: dict[str, Any]
    files: tuple[str, ...]
    sha256: dict[str, str]
    identity: dict[str, Any]


# identity key -> its path in the run config dict: what defines the model a checkpoint's weights belong to.
IDENTITY_FIELDS: dict[str, tuple[str, ...]] = {
    "router": ("router", "name"), "router_options": ("router", "options"), "flavour": ("model", "flavour"),
    "num_experts": ("model", "num_experts"), "top_k": ("model", "top_k"), "seq_length": ("model", "seq_length"),
    "vocab_size": ("data", "vocab_size"),
}


def _json_plain(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists, keys strings), for comparisons."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def run_identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """:data:`IDENTITY_FIELDS` of a ``RunConfig.to_dict()``, JSON-plain, router options sorted, missing None."""
    def lookup(value: Any, part: str) -> Any:
        return value.get(part) if isinstance(value, Mapping) else None

    identity = {key: functools.reduce(lookup, path, config) for key, path in IDENTITY_FIELDS.items()}
    identity["router_options"] = dict(sorted(dict(identity["router_options"] or {}).items()))
    return _json_plain(identity)


def _check_identity(found: Any, expected: Mapping[str, Any], message: Callable[[str, str], str]) -> None:
    """ReproError ``message(found's description, expected's)`` unless the identities match (JSON-plain); each
    description names the router, then every field that differs."""
    found, expected = _json_plain(found), _json_plain(expected)
    if found != expected:
        pair = (found or {}, expected)
        keys = ["router"] + [k for k in IDENTITY_FIELDS if k != "router" and pair[0].get(k) != pair[1].get(k)]
        raise ReproError(message(*(", ".join(f"{k} {i.get(k)!r}" for k in keys) for i in pair)))


def check_identity(info: CheckpointInfo, config: Mapping[str, Any]) -> None:
    """ReproError if the checkpoint's model is not ``config``'s (e.g. another router's)."""
    _check_identity(info.identity, run_identity(config),
                    lambda stored, wanted: f"{info.path}: a checkpoint of {stored}, but this run is {wanted}")


def check_payload_identity(payload: dict[str, Any], info: CheckpointInfo, path: Path) -> None:
    """ReproError if rank file ``path`` was written by another run than its ``meta.json`` describes."""
    _check_identity(payload.get("identity"), info.identity, lambda theirs, ours: (
        f"{path}: written by a run of {theirs}, but {info.path / 'meta.json'} is a run of {ours}; refusing to load "
        "another run's weights"))


def capture_rng_state() -> dict[str, Any]:
    """Every RNG state a step may draw from, as tensors and plain numbers (``weights_only`` loadable)."""
    py_version, py_internal, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        # internal: 624 words + position, all < 2**32
        "python": {"version": int(py_version), "internal": torch.tensor(py_internal, dtype=torch.int64),
                   "gauss_next": py_gauss},
        "numpy": {"kind": str(np_kind), "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
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
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss_next"]))
    nps = state["numpy"]
    np.random.set_state(
        (nps["kind"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"], nps["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        if "megatron_tracker" in state:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            get_cuda_rng_tracker().set_states(state["megatron_tracker"])


# Exact types: a subclass (numpy float64, str enum) pickles as its own class, refused by weights_only.
_PLAIN_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.Size, torch.device, torch.dtype)
_PLAIN_CONTAINERS = (dict, OrderedDict, Counter, list, tuple, set)


def check_plain_data(obj: Any, where: str = "payload") -> None:
    """``ValueError`` naming the key path of the first value ``weights_only`` loading could not read back."""
    if type(obj) in (torch.Tensor, nn.Parameter) or type(obj) in _PLAIN_LEAVES:
        return
    if type(obj) in _PLAIN_CONTAINERS:
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            if isinstance(obj, dict) and not isinstance(key, (str, int)):
                raise ValueError(f"checkpoint key {where}[{key!r}] is a {type(key).__name__}; keys must be str or int")
            check_plain_data(value, f"{where}[{key!r}]")
        return
    raise ValueError(
        f"checkpoint value {where} is a {type(obj).__module__}.{type(obj).__qualname__}: only tensors and plain "
        "Python data (str, numbers, bool, None, dict, list, tuple) are saved, so that loading never runs code"
    )


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def all_ranks_reduce(value: int, op: dist.ReduceOp) -> int:
    """``value`` all-reduced with ``op`` over all processes (collective)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return value
    return int(all_reduce(torch.tensor([value], dtype=torch.int32), op=op).item())


def _agree(error: BaseException | None, final: Path, remove: Path | None = None) -> None:
    """The barrier between write phases (a plain one would hang on a failure): unless every rank succeeded,
    remove ``remove`` and raise this rank's own error, or say that another rank failed."""
    if all_ranks_reduce(int(error is None), dist.ReduceOp.MIN):
        return
    if remove is not None:
        shutil.rmtree(remove, ignore_errors=True)
    if error is None:
        raise ReproError(f"{final}: checkpoint not written: the write failed on another rank")
    if isinstance(error, ReproError):
        raise error from None
    raise error


def _is_own_dir(path: Path) -> bool:
    """Whether ``path`` is a real directory (not a link) holding only what a checkpoint write puts there."""
    return not path.is_symlink() and path.is_dir() and all(_OWN_ENTRY.match(c.name) for c in path.iterdir())


def _remove_own_dir(path: Path) -> None:
    """Remove a checkpoint directory (complete or left by a kill) this module wrote; refuse anything else."""
    if not os.path.lexists(path):
        return
    if not _is_own_dir(path):
        raise ReproError(f"{path}: in the way of a checkpoint write but not a checkpoint directory (a link, a file, or "
                         "holding other files); refusing to remove it")
    shutil.rmtree(path)


def save_checkpoint(
    checkpoints_dir: str | os.PathLike, *, step: int, consumed_samples: int, parallel: Parallel,
    experiment: dict[str, Any], model: nn.Module, optimizer_state: dict[str, Any], scheduler_state: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write one checkpoint (collective: every rank calls it); returns its directory.

    Args:
        checkpoints_dir: ``OUT/checkpoints``.
        step: completed optimizer steps.
        consumed_samples: samples consumed by all ranks together.
        experiment: run config dict (in ``meta.json``; the run identity comes from it).
        optimizer_state: already gathered where the optimizer needs it.
        extra: more per-rank entries.

    Raises:
        ReproError: the write failed on some rank, or a non-checkpoint directory is in the way.
        ValueError: a state holds something other than tensors or plain data (names the key).
    """
    root = Path(checkpoints_dir)
    final = root / f"step_{step:07d}"
    tmp = root / f".{final.name}.tmp"
    aside = root / f".{final.name}.old.tmp"
    identity = run_identity(experiment)
    common = {"format": FORMAT_VERSION, "step": step, "consumed_samples": consumed_samples}

    # ---- phase 1 (rank 0): a clean temporary directory
    error = _attempt(lambda: _fresh_dir(root, tmp), final, tmp) if parallel.is_main else None
    _agree(error, final)

    # ---- phase 2 (every rank): its file, then its digest beside it (``<name>.sha256``)
    def write_rank_file() -> None:
        payload = {**common, "rank": parallel.rank, "ep_rank": parallel.ep_rank, "ep_size": parallel.ep_size,
                   "identity": identity, "model": model.state_dict(), "optimizer": optimizer_state,
                   "scheduler": scheduler_state, "rng": capture_rng_state(), "extra": extra or {}}
        check_plain_data(payload)
        target = tmp / _rank_file_name(parallel.rank)
        # A file object keeps a failed write's OSError as context of torch's RuntimeError (names the cause).
        write_synced(target, "wb", lambda f: torch.save(payload, f))
        # Read by rank 0 only after every rank reported success, so no partial sidecar is ever read.
        write_synced(tmp / f"{target.name}.sha256", "w", lambda f: f.write(file_sha256(target) + "\n"))

    error = _attempt(write_rank_file, final, tmp)
    _agree(error, final, remove=tmp if parallel.is_main else None)  # made by phase 1 of this call

    # ---- phase 3 (rank 0): meta.json, then the rename that makes the checkpoint exist
    if parallel.is_main:
        meta = {**common, "layout": parallel.layout(), "identity": identity, "experiment": experiment}
        error = _attempt(lambda: _publish(root, tmp, final, aside, meta, parallel.world_size), final, tmp)
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            if os.path.lexists(aside) and not os.path.lexists(final):
                os.replace(aside, final)  # the earlier checkpoint of this step goes back
    _agree(error, final)
    return final


def _attempt(action: Callable[[], None], final: Path, tmp: Path) -> BaseException | None:
    """Run this rank's part of a phase; return (not raise: all ranks must hear first) its error, OS errors named."""
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
        return exc if isinstance(exc, ReproError) else error_from_os_error(exc, final, tmp) or exc
    return None


def _fresh_dir(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    _remove_own_dir(tmp)  # left by a run killed while writing this step
    tmp.mkdir()


def _publish(root: Path, tmp: Path, final: Path, aside: Path, meta: dict[str, Any], world_size: int) -> None:
    """Phase 3 (rank 0): ``meta.json``, rename to ``final``, update ``latest``; an existing ``final`` (step re-run
    after an earlier resume) waits in ``aside`` until replaced (the caller restores it on failure)."""
    files = [_rank_file_name(r) for r in range(world_size)]
    digests = {name: (tmp / f"{name}.sha256").read_text().strip() for name in files}
    for name in files:
        (tmp / f"{name}.sha256").unlink()
    meta = {**meta, "files": files, "sha256": digests}
    write_synced(tmp / "meta.json", "w", lambda f: f.write(json.dumps(meta, indent=2) + "\n"))
    _remove_own_dir(aside)
    if os.path.lexists(final):
        if not _is_own_dir(final):
            _remove_own_dir(final)  # raises: not a checkpoint directory
        os.replace(final, aside)
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)
    with atomic_path(root / "latest") as part:
        part.write_text(final.name + "\n")


def read_checkpoint_info(path: str | os.PathLike) -> CheckpointInfo:
    """Read and check a checkpoint's ``meta.json`` (ReproError: missing/corrupt, other format, missing file/digest)."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ReproError(f"{path}: not a checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
        fmt = meta.get("format", 1)
        if fmt != FORMAT_VERSION:
            raise ReproError(
                f"{meta_path}: checkpoint format {fmt}, this version reads format {FORMAT_VERSION} (tensors and "
                "plain data with sha256 digests); older checkpoints pickle numpy objects and cannot be loaded "
                "without trusting them to run code"
            )
        info = CheckpointInfo(
            path=path, step=int(meta["step"]), consumed_samples=int(meta["consumed_samples"]),
            layout={k: int(v) for k, v in meta["layout"].items()}, experiment=dict(meta["experiment"]),
            files=tuple(meta["files"]), sha256={str(k): str(v) for k, v in meta["sha256"].items()},
            identity=dict(meta["identity"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ReproError(f"{meta_path}: corrupt checkpoint metadata ({type(exc).__name__}: {exc})") from None
    for name in info.files:
        if not (path / name).is_file():
            raise ReproError(f"{path / name}: checkpoint file missing")
        if name not in info.sha256:
            raise ReproError(f"{meta_path}: corrupt checkpoint metadata (no sha256 for {name})")
    return info


def _step_dirs(checkpoints_dir: str | os.PathLike, pattern: re.Pattern, keep: Callable[[Path], bool]) -> list[Path]:
    """The directories in ``checkpoints_dir`` that ``pattern`` names and ``keep`` accepts, oldest step first."""
    root = Path(checkpoints_dir)
    children = root.iterdir() if root.is_dir() else []
    found = [(int(m.group(1)), c) for c in children if (m := pattern.match(c.name)) and c.is_dir() and keep(c)]
    return [p for _, p in sorted(found)]


def find_latest_checkpoint(checkpoints_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory (one with its ``meta.json``) under ``checkpoints_dir``, or None."""
    complete = _step_dirs(checkpoints_dir, STEP_DIR, lambda p: (p / "meta.json").is_file())
    return complete[-1] if complete else None


def incomplete_checkpoints(checkpoints_dir: str | os.PathLike) -> list[Path]:
    """``.step_XXXXXXX.tmp`` directories left by runs killed mid-write, oldest step first."""
    return _step_dirs(checkpoints_dir, INCOMPLETE_DIR, lambda p: not p.is_symlink())


def _load_plain(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain data; any other object is refused, never built."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0] if lines else "")
        raise ReproError(f"{path}: refusing to load: it holds objects other than tensors and plain data "
                         f"({detail})") from None
    except OSError as exc:
        raise ReproError(os_error_message(exc, path)) from None
    except Exception as exc:  # noqa: BLE001 - any other reading failure is "corrupt" to the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ReproError(f"{path}: corrupt checkpoint file ({type(exc).__name__}: {first})") from None


def load_rank_payload(info: CheckpointInfo, rank: int) -> dict[str, Any]:
    """One rank's payload, digest checked (ReproError: changed, another run's, non-plain objects, unreadable)."""
    name = info.files[rank]
    path = info.path / name
    try:
        actual = file_sha256(path)
    except OSError as exc:
        raise ReproError(os_error_message(exc, path)) from None
    expected = info.sha256.get(name, "")
    if actual != expected:
        # Safe to look inside (weights_only): another run's file gets a clearer message.
        try:
            other = _load_plain(path)
        except ReproError:
            other = None
        if isinstance(other, dict) and isinstance(other.get("identity"), dict):
            check_payload_identity(other, info, path)
        raise ReproError(
            f"{path}: changed since it was written (sha256 {actual[:16]}..., {info.path / 'meta.json'} records "
            f"{expected[:16]}...); refusing to load it"
        )
    payload = _load_plain(path)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION or "model" not in payload:
        raise ReproError(f"{path}: not a checkpoint file of format {FORMAT_VERSION}")
    check_payload_identity(payload, info, path)
    return payload


def check_same_layout(info: CheckpointInfo, parallel: Parallel) -> None:
    if info.layout != parallel.layout():
        raise ReproError(
            f"{info.path}: written by layout {info.layout}, this run is {parallel.layout()}; resume with the "
            "same torchrun size, tp and ep (or start a new run with --set init_from=<checkpoint>)"
        )


def _to_global_key(key: str, ep_rank: int, num_local: int) -> str:
    def shift(m: re.Match) -> str:  # the expert number, and the separator after it (sequential experts only)
        return f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3) if m.re.groups == 3 else ''}"

    return _GROUPED_EXPERT.sub(shift, _SEQUENTIAL_EXPERT.sub(shift, key))


def _num_local_experts(keys) -> int:
    found = {int(m.group(2)) for key in keys for p in (_SEQUENTIAL_EXPERT, _GROUPED_EXPERT) if (m := p.search(key))}
    return max(found) + 1 if found else 0


def global_model_state(payloads: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Merge rank payloads (covering every EP rank) into one state with global expert numbering."""
    merged: dict[str, torch.Tensor] = {}
    for payload in payloads:
        state = payload["model"]
        num_local = _num_local_experts(state)
        for key, value in state.items():
            merged.setdefault(_to_global_key(key, int(payload.get("ep_rank", 0)), num_local), value)
    return merged


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` if it holds ``meta.json``, else the newest checkpoint in it or its ``checkpoints/``, else ``path``."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    return find_latest_checkpoint(path) or find_latest_checkpoint(path / "checkpoints") or path


def find_router_checkpoint(candidates: list[Path], router: str) -> CheckpointInfo | None:
    """The first of ``candidates`` (:func:`resolve_checkpoint`) holding a ``router`` checkpoint (``dense``: none)."""
    for candidate in candidates:
        path = resolve_checkpoint(candidate)
        if (path / "meta.json").is_file():
            info = read_checkpoint_info(path)
            if ((info.experiment.get("router") or {}).get("name") or "dense") == router:
                return info
    return None


def load_model_weights(path: str | os.PathLike, model: nn.Module, parallel: Parallel) -> CheckpointInfo:
    """Initialise ``model`` from a checkpoint of any DP/EP layout (:func:`resolve_checkpoint`); returns its info."""
    path = resolve_checkpoint(path)
    info = read_checkpoint_info(path)
    if info.layout == parallel.layout():
        _load_strict(model, load_rank_payload(info, parallel.rank)["model"], path)
    else:
        state_global = global_model_state([load_rank_payload(info, r) for r in range(len(info.files))])
        load_global_state(model, state_global, parallel, str(path))
    return info


def load_global_state(model: nn.Module, state_global: dict[str, torch.Tensor], parallel: Parallel, source: str) -> None:
    """Load this rank's part of a global-numbered state (:func:`global_model_state`); ReproError if it does not fit."""
    local_keys = list(model.state_dict().keys())
    num_local = _num_local_experts(local_keys)
    global_keys = {key: _to_global_key(key, parallel.ep_rank, num_local) for key in local_keys}
    if missing := [gkey for gkey in global_keys.values() if gkey not in state_global]:
        raise ReproError(f"{source}: lacks {len(missing)} weight(s) of this model, e.g. {missing[0]}")
    _load_strict(model, {key: state_global[gkey] for key, gkey in global_keys.items()}, source)


def _load_strict(model: nn.Module, state: dict[str, torch.Tensor], source) -> None:
    own = model.state_dict()
    for key in (k for k in state if k.endswith("embedding.word_embeddings.weight") and k in own):
        if state[key].shape[0] != own[key].shape[0]:  # the likeliest misfit, named as such
            raise ReproError(
                f"{source}: a checkpoint of another vocabulary ({state[key].shape[0]} embedding rows, padded; this "
                f"model has {own[key].shape[0]}): start from a run on the same data and tokenizer (its meta.json's "
                "experiment.data)"
            )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ReproError(f"{source}: checkpoint weights do not fit this model ({first})") from None
