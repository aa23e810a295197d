"""Counting what a piece of PyTorch code asks of the device, independent of the hardware: the ATen ops it
dispatches, which run outside compiled regions, how many compiled regions it enters, which force a host
synchronisation (:func:`host_sync_reason`), and an estimate of the bytes it moves.

:class:`OpCounter` also wraps inductor's ``CompiledFxGraph.__call__``: one call is one region, whose ops (extern
kernels) count as inside. The launch proxy and the bytes moved (a lower bound): docs/efficiency.md. Host syncs:
value reads, data-dependent sizes (incl. boolean-mask indexing, ``repeat_interleave`` without ``output_size``),
blocking host/device copies, ``Tensor.tolist``/``numpy``; ``torch.tensor(data, device=...)`` is not seen.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: Operators that read a device value on the host, whatever their arguments.
VALUE_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "allclose"})
#: Operators whose output size depends on the data (the host must wait to allocate).
DATA_DEPENDENT_SHAPES = frozenset(
    {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
     "bincount"}
)
#: Indexing operators that run ``nonzero`` when an index is a boolean mask.
MASK_INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_"})


def host_sync_reason(func, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why a call of the ATen overload ``func`` syncs the host: the op's name, ``"<name>(bool mask)"``,
    ``"repeat_interleave(no output_size)"`` or ``"<name>(cross-device copy)"``; None if it does not."""
    name = func.overloadpacket.__name__
    if name in VALUE_READS or name in DATA_DEPENDENT_SHAPES:
        return name
    if name in MASK_INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        mask = any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
        return f"{name}(bool mask)" if mask else None
    if name == "repeat_interleave":
        # Tensor repeats: the output size is their sum, read on the host unless given.
        by_tensor = func._overloadname in ("Tensor", "self_Tensor")
        return "repeat_interleave(no output_size)" if by_tensor and kwargs.get("output_size") is None else None
    if name in ("_to_copy", "copy_") and not kwargs.get("non_blocking", False):
        both = {v.device.type for v in args[: 2 if name == "copy_" else 1] if torch.is_tensor(v)}
        if name == "_to_copy" and kwargs.get("device") is not None:
            both.add(torch.device(kwargs["device"]).type)
        if "cpu" in both and len(both) > 1:
            return f"{name}(cross-device copy)"
    return None


@dataclass
class OpCounts:
    """What one :class:`OpCounter` saw.

    Attributes:
        dispatched, outside, views: ATen ops dispatched; those outside compiled regions; view ops among them.
        regions, region_kernels: compiled regions entered; generated plus extern kernels they ran.
        syncs, sync_ops: host synchronisations; their :func:`host_sync_reason` -> count.
        bytes_moved: the estimate of docs/efficiency.md (a lower bound).
        ops, outside_ops: name -> count, all and outside compiled regions.
    """

    dispatched: int = 0
    outside: int = 0
    views: int = 0
    regions: int = 0
    region_kernels: int = 0
    syncs: int = 0
    bytes_moved: int = 0
    sync_ops: collections.Counter = field(default_factory=collections.Counter)
    outside_ops: collections.Counter = field(default_factory=collections.Counter)
    ops: collections.Counter = field(default_factory=collections.Counter)

    @property
    def launches(self) -> int:
        """The launch proxy: ``outside + region_kernels``."""
        return self.outside + self.region_kernels


def _tensor_bytes(values) -> int:
    tensors = {id(v): v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)}  # each tensor once
    return sum(t.numel() * t.element_size() for t in tensors.values())


#: A generated kernel's call in a compiled graph's ``call``: ``cpp_fused_*(...)`` or ``triton_*.run(...)``.
_KERNEL_CALL = re.compile(r"^\s+(?:cpp_fused_\w+\(|triton_\w+\.run\()", re.MULTILINE)


def generated_kernels(source_code: str) -> int:
    """Generated-kernel call sites in a compiled graph's ``call`` (kernels launched per call)."""
    start = source_code.find("def call(")
    return len(_KERNEL_CALL.findall(source_code, start)) if start >= 0 else 0


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as counter: ...``, then read ``counter.counts`` (an :class:`OpCounts`).

    Compiled code stays compiled; call a ``torch.compile`` function once before, or its compilation is counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts = OpCounts()
        self._depth = 0
        self._restore: list = []
        self._kernels: dict[int, int] = {}  # id of a compiled graph -> its generated kernels per call

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Otherwise dynamo runs compiled code eagerly under this mode.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counts
        c.dispatched += 1
        name = func._overloadpacket.__name__
        c.ops[name] += 1
        reason = host_sync_reason(func, args, kwargs)
        if reason is not None:
            c.syncs += 1
            c.sync_ops[reason] += 1
        view = _is_view(func)
        if self._depth > 0:
            c.region_kernels += not view  # a non-view op there is an extern kernel the region calls
        else:
            c.outside += 1
            c.outside_ops[name] += 1
            c.views += view
            if not view:
                c.bytes_moved += _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        return out

    def __enter__(self):
        from torch._inductor.output_code import CompiledFxGraph

        counter = self

        def region(original):
            def call(graph, inputs):
                counter.counts.regions += 1
                if id(graph) not in counter._kernels:  # the graph's code, read once
                    counter._kernels[id(graph)] = generated_kernels(getattr(graph, "source_code", "") or "")
                counter.counts.region_kernels += counter._kernels[id(graph)]
                counter.counts.bytes_moved += _tensor_bytes(inputs)
                counter._depth += 1
                try:
                    out = original(graph, inputs)
                finally:
                    counter._depth -= 1
                counter.counts.bytes_moved += _tensor_bytes(out)
                return out

            return call

        def host_read(original):
            def read(tensor, *args, **kwargs):
                counter.counts.syncs += 1
                counter.counts.sync_ops[original.__name__] += 1
                return original(tensor, *args, **kwargs)

            return read

        for owner, attr, wrapper in ((CompiledFxGraph, "__call__", region), (torch.Tensor, "tolist", host_read),
                                     (torch.Tensor, "numpy", host_read)):
            self._restore.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, wrapper(getattr(owner, attr)))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, attr, original in reversed(self._restore):
                setattr(owner, attr, original)
            self._restore.clear()
