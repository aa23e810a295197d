"""Counting what a piece of PyTorch code asks of the device, independent of the hardware: the ATen ops it
dispatches, which of them run outside compiled regions, how many compiled regions it enters, which ops force a
host synchronisation, and an estimate of the bytes it moves.

:class:`OpCounter` is a ``TorchDispatchMode`` (every ATen op that reaches the dispatcher, forward and backward)
that also wraps inductor's compiled graphs (``CompiledFxGraph.__call__``): a call of one is one compiled region
entered, and the ATen ops dispatched while it runs (its extern kernels: matmuls, random seeds, fallbacks) are
counted as inside it. On a GPU every op outside a compiled region is at least one kernel launch, and a compiled
region a few (one per fused kernel it generated), so ``outside + regions`` is the proxy for launches.

Estimated bytes moved: for each op outside a compiled region that is not a view (a view moves no data), the
bytes of its tensor inputs plus its tensor outputs (each tensor counted once per op, as if read or written
once: ops that read an input twice, or reductions that write less, are not modelled); for each compiled region,
the bytes of its inputs plus its outputs (what a fully fused region must read and write at least; its
intermediates stay in registers or cache only if inductor fused them, so this is a lower bound for a region).

Host synchronisations: the ops that make the host wait for the device to learn a value or a shape
(:data:`SYNC_OPS`), boolean-mask indexing (``aten.index`` / ``index_put`` with a bool index: a ``nonzero``
inside the kernel), and ``Tensor.tolist`` / ``Tensor.numpy`` (on a CPU tensor they read memory without
dispatching an op; counted by wrapping them while the counter is active).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["SYNC_OPS", "OpCounter", "OpCounts"]

#: ATen ops (overload packets) that force a device-to-host synchronisation: their result is a host value
#: (``_local_scalar_dense``: ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``; ``is_nonzero``; ``equal``)
#: or their output's shape depends on the data (``nonzero``, ``masked_select``, ``unique``, ``bincount``,
#: ``repeat_interleave`` without ``output_size``, ...), or they check a result on the host (the linalg ops
#: that raise on a singular input).
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense", "item", "is_nonzero", "equal", "allclose",
        "nonzero", "nonzero_numpy", "argwhere", "masked_select", "masked_scatter",
        "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "unique_dim_consecutive",
        "bincount", "histc", "histogram", "repeat_interleave", "_assert_async",
        "linalg_inv", "inverse", "cholesky", "linalg_cholesky", "linalg_solve", "_linalg_check_errors",
    }
)


@dataclass
class OpCounts:
    """What one :class:`OpCounter` saw.

    Attributes:
        dispatched: ATen ops dispatched (inside and outside compiled regions).
        outside: ops dispatched outside any compiled region.
        views: of ``outside``, view ops (metadata only, no kernel on a GPU).
        regions: compiled regions entered.
        syncs: host synchronisations.
        bytes_moved: the estimate of the module docstring.
        sync_ops: name -> count of the synchronising ops (to say which).
        outside_ops: name -> count of the ops outside compiled regions.
    """

    dispatched: int = 0
    outside: int = 0
    views: int = 0
    regions: int = 0
    syncs: int = 0
    bytes_moved: int = 0
    sync_ops: collections.Counter = field(default_factory=collections.Counter)
    outside_ops: collections.Counter = field(default_factory=collections.Counter)

    @property
    def launches(self) -> int:
        """The launch proxy: ops outside compiled regions plus compiled regions entered."""
        return self.outside + self.regions


def _tensor_bytes(values) -> int:
    seen: set[int] = set()
    total = 0
    for value in tree_flatten(values)[0]:
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            total += value.numel() * value.element_size()
    return total


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _bool_index(func, args) -> bool:
    if func._overloadpacket.__name__ not in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as counter: ...``, then read ``counter.counts`` (an :class:`OpCounts`).

    Compiled code runs compiled under it (``ignore_compile_internals``): a function compiled with
    ``torch.compile`` must have been compiled (called once) before, or its compilation runs inside the counter.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts = OpCounts()
        self._depth = 0
        self._restore: list = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile'd code run compiled under this mode (otherwise dynamo runs it eagerly).
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counts
        c.dispatched += 1
        name = func._overloadpacket.__name__
        if name in SYNC_OPS or _bool_index(func, args):
            c.syncs += 1
            c.sync_ops[name] += 1
        if self._depth == 0:
            c.outside += 1
            c.outside_ops[name] += 1
            if _is_view(func):
                c.views += 1
            else:
                c.bytes_moved += _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        return out

    def _wrap(self, owner, attr, wrapper_factory) -> None:
        original = getattr(owner, attr)
        setattr(owner, attr, wrapper_factory(original))
        self._restore.append((owner, attr, original))

    def __enter__(self):
        from torch._inductor.output_code import CompiledFxGraph

        counter = self

        def region(original):
            def call(graph, inputs):
                counter.counts.regions += 1
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

        self._wrap(CompiledFxGraph, "__call__", region)
        for attr in ("tolist", "numpy"):
            self._wrap(torch.Tensor, attr, host_read)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, attr, original in reversed(self._restore):
                setattr(owner, attr, original)
            self._restore.clear()
