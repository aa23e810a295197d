"""The plain data of a checkpoint besides the weights (:mod:`repro.training.checkpoint` has the layout):
what ``meta.json`` says, the run's identity and its checks, RNG states stored as tensors and plain numbers,
the plain-data check that keeps a checkpoint loadable without code, and file digests.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from repro.errors import ReproError


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
    sha256: dict[str, str] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)


# identity key -> its path in the run config dict: what defines the model a checkpoint's weights belong to.
IDENTITY_FIELDS: dict[str, tuple[str, ...]] = {
    "router": ("router", "name"),
    "router_options": ("router", "options"),
    "flavour": ("model", "flavour"),
    "num_experts": ("model", "num_experts"),
    "top_k": ("model", "top_k"),
    "seq_length": ("model", "seq_length"),
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


def _describe_pair(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> tuple[str, str]:
    """Short descriptions of two identities: the router, then every field that differs."""
    keys = ["router"] + [k for k in IDENTITY_FIELDS if k != "router" and ours.get(k) != theirs.get(k)]
    described = [", ".join(f"{k} {identity.get(k)!r}" for k in keys) for identity in (ours, theirs)]
    return described[0], described[1]


def check_identity(info: CheckpointInfo, config: Mapping[str, Any], what: str = "this run") -> None:
    """ReproError if the checkpoint's model is not ``config``'s (e.g. another router's); ``what`` names the run."""
    expected = run_identity(config)
    if _json_plain(info.identity) != expected:
        stored, wanted = _describe_pair(info.identity, expected)
        raise ReproError(f"{info.path}: a checkpoint of {stored}, but {what} is {wanted}")


def check_payload_identity(payload: dict[str, Any], info: CheckpointInfo, path: Path) -> None:
    """ReproError if rank file ``path`` was written by another run than its ``meta.json`` describes."""
    found = _json_plain(payload.get("identity"))
    if found != _json_plain(info.identity):
        theirs, ours = _describe_pair(found or {}, info.identity)
        raise ReproError(f"{path}: written by a run of {theirs}, but {info.path / 'meta.json'} is a run of {ours}; "
                         "refusing to load another run's weights")


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
    """The sha256 hex digest of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()

