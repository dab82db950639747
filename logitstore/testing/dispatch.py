"""What a training step asks of torch, counted: the top-level aten ops it dispatches and the host syncs
among them, with a `TorchDispatchMode` (the ops as they reach Python dispatch: what autograd, FSDP and
the optimizer call, not what a kernel calls inside itself). Counted the same way for any loop, so two
loops' counts compare on the CPU as they would on a GPU, where every top-level op is at least one launch.

A host sync is what makes the host wait for the device on a GPU:
  item       `aten._local_scalar_dense` (`.item()`, `float(t)`, `int(t)`, `bool(t)`)
  copy       a copy from a device tensor to the host (`.cpu()`, `.tolist()` and `.numpy()` of one)
  shape      an op whose output's shape depends on the data (`nonzero`, boolean-mask indexing, `unique`,
             `masked_select`): the host must read a count before it can allocate the result
On the CPU no tensor is on a device, so `copy` counts nothing there; `item` and `shape` count the same
as on a GPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SHAPE_OPS = {
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}
INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
COPY_OPS = {aten._to_copy.default, aten.copy_.default}


@dataclass
class DispatchCount:
    """Counts of one stretch of work: `ops` by op name, `syncs` by kind (item, copy, shape) and op name."""

    ops: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)

    @property
    def n_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def n_syncs(self) -> int:
        return sum(self.syncs.values())


class CountingMode(TorchDispatchMode):
    """`with CountingMode() as mode:` ... `mode.count` (a `DispatchCount`); `mode.take()` returns the count
    so far and starts a new one (one count per step)."""

    def __init__(self):
        super().__init__()
        self.count = DispatchCount()

    def take(self) -> DispatchCount:
        count, self.count = self.count, DispatchCount()
        return count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        self.count.ops[name] += 1
        kind = sync_kind(func, args, kwargs)
        if kind is not None:
            self.count.syncs[f"{kind}:{name}"] += 1
        return func(*args, **kwargs)


def sync_kind(func, args, kwargs) -> str | None:
    """'item', 'copy' or 'shape' for an op that makes the host wait on a GPU; None for any other."""
    if func is aten._local_scalar_dense.default:
        return "item"
    if func in SHAPE_OPS:
        return "shape"
    if func in INDEX_OPS and any(_is_mask(i) for i in _indices(func, args, kwargs)):
        return "shape"
    if func in COPY_OPS and _to_host(func, args, kwargs):
        return "copy"
    return None


def _indices(func, args, kwargs) -> list:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
    return list(indices or [])


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _to_host(func, args, kwargs) -> bool:
    if func is aten.copy_.default:  # copy_(destination, source)
        destination, source = args[0], args[1]
    else:  # _to_copy(source, device=...)
        source, destination = args[0], kwargs.get("device")
    where = destination.device if isinstance(destination, torch.Tensor) else destination
    return (
        isinstance(source, torch.Tensor)
        and source.device.type not in ("cpu", "meta")
        and where is not None
        and torch.device(where).type == "cpu"
    )
