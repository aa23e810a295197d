"""Counting the ATen operators a piece of code dispatches, and the host synchronisations among them.

On a GPU every dispatched operator is at least one kernel launch, and an operator that reads a device value
on the host (``.item()``, ``bool(t)``, a data-dependent output size) stalls the host until the device has
caught up, so the launch queue runs dry. Both are properties of the code, not of the machine: counted here
with a :class:`torch.utils._python_dispatch.TorchDispatchMode` on CPU, they say what the code will cost on
a GPU. Forward and backward are both seen (the autograd engine carries the mode to the backward).

Host synchronisations recognised (:func:`host_sync_reason`):

* reading a value: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``),
  ``aten.is_nonzero``, ``aten.equal``, ``aten.allclose``;
* an output whose size depends on the data: ``aten.nonzero``, ``aten.masked_select``, the ``unique``
  family, ``aten.bincount``, ``aten.repeat_interleave`` by a tensor without ``output_size``, and indexing
  (``aten.index``, ``aten.index_put``) with a boolean mask (it runs ``nonzero``);
* a blocking copy between the host and an accelerator (``aten._to_copy`` / ``aten.copy_`` across devices
  without ``non_blocking``); on a CPU-only machine every tensor is on the host, so these cannot occur there.

Not seen: ``Tensor.tolist()`` and ``Tensor.numpy()`` of a CPU tensor (they read memory without dispatching an
operator; on a GPU tensor they dispatch the device-to-host copy above), and ``torch.tensor(data,
device=...)`` (built below the dispatcher). ``aten.nonzero_static`` and ``aten._assert_async`` do not
synchronise (fixed output size; a device-side assert).

Usage::

    with DispatchCounter() as counter:
        out = router(hidden_TD)
        out.probs.sum().backward()
    counter.total_ops, counter.host_syncs   # Counter of op names -> count, of sync reasons -> count
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Operators that read a device value on the host, whatever their arguments.
VALUE_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "allclose"})
#: Operators whose output size depends on the data (the host waits for it before it can allocate).
DATA_DEPENDENT_SHAPES = frozenset(
    {
        "nonzero",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "bincount",
    }
)
#: Indexing operators that run ``nonzero`` when an index is a boolean mask.
MASK_INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_"})


def _is_mask(value: Any) -> bool:
    return torch.is_tensor(value) and value.dtype in (torch.bool, torch.uint8)


def _devices(values: Any) -> set[str]:
    found: set[str] = set()
    for value in values if isinstance(values, (list, tuple)) else (values,):
        if torch.is_tensor(value):
            found.add(value.device.type)
    return found


def host_sync_reason(func, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why an operator call forces a host synchronisation, or None if it does not.

    Args:
        func: the ATen operator overload (``torch.ops.aten.<name>.<overload>``).
        args: its positional arguments.
        kwargs: its keyword arguments.

    Returns:
        The operator's name (a value read or data-dependent size), ``"<name>(bool mask)"``,
        ``"repeat_interleave(no output_size)"``, ``"<name>(cross-device copy)"``, or None.
    """
    name = func.overloadpacket.__name__
    if name in VALUE_READS or name in DATA_DEPENDENT_SHAPES:
        return name
    if name in MASK_INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return f"{name}(bool mask)" if any(_is_mask(i) for i in indices or ()) else None
    if name == "repeat_interleave":
        # Repeats given as a tensor: the output size is their sum, read on the host unless given.
        by_tensor = func._overloadname in ("Tensor", "self_Tensor")
        return "repeat_interleave(no output_size)" if by_tensor and kwargs.get("output_size") is None else None
    if name in ("_to_copy", "copy_") and not kwargs.get("non_blocking", False):
        if name == "copy_":
            both = _devices(args[:2])
        else:
            target = kwargs.get("device")
            both = _devices(args[:1]) | ({torch.device(target).type} if target is not None else set())
        if "cpu" in both and len(both) > 1:
            return f"{name}(cross-device copy)"
    return None


class DispatchCounter(TorchDispatchMode):
    """Counts every ATen operator dispatched inside the ``with`` block, and the host synchronisations.

    Attributes:
        ops: ``Counter`` of operator names (``"mm"``, ``"softmax"``, ...).
        host_syncs: ``Counter`` of :func:`host_sync_reason` values.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.host_syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        reason = host_sync_reason(func, args, kwargs)
        if reason is not None:
            self.host_syncs[reason] += 1
        return func(*args, **kwargs)

    @property
    def total_ops(self) -> int:
        """Operators dispatched."""
        return sum(self.ops.values())

    @property
    def total_syncs(self) -> int:
        """Host synchronisations among them."""
        return sum(self.host_syncs.values())


__all__ = ["DATA_DEPENDENT_SHAPES", "MASK_INDEXING", "VALUE_READS", "DispatchCounter", "host_sync_reason"]
