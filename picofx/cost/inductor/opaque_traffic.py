"""The memory traffic inside an opaque op (a custom op Inductor calls as it is, e.g. picofx's fused
loss), counted by running the op's CPU implementation on fake tensors and recording every ATen op
it dispatches, then grouping them as a fusing compiler (Inductor, or a hand-written Triton kernel)
runs them: each matmul is a kernel of its own, and the ops between two matmuls are one kernel that
reads what it did not write itself and writes what is read after it or returned. So a chunked
loss counts, per chunk, its logits matmul, one softmax pass over the chunk's logits, its two
gradient matmuls and the accumulation into the weight gradient; what it does not count is the
extra pass an unfused implementation makes over a value between two of its ops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
import torch.utils._pytree as pytree


aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.mm.out, aten.addmm.default, aten.addmm.out, aten.addmm_.default, aten.bmm.default,
           aten.bmm.out, aten.baddbmm.default, aten.matmul.default, aten._scaled_mm.default}
ALLOCATIONS = {aten.empty.memory_format, aten.new_empty.default, aten.empty_strided.default, aten.empty_like.default,
               aten.new_empty_strided.default, torch.ops.prim.device.default}


@dataclass(frozen=True)
class OpaqueTraffic:
    read: int
    written: int
    kernels: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _Op:
    matmul: bool
    reads: dict  # storage -> bytes loaded
    writes: dict  # storage -> bytes stored


class _Recorder(TorchDispatchMode):
    """Each dispatched op's tensor reads and writes, by storage; views and allocations move nothing.
    Storages are keyed by address, each tensor seen kept alive until the recording ends so that no
    address is reused (weak references to fake storages crashed the garbage collector later)."""

    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.seen: list[torch.Tensor] = []

    def key(self, t: torch.Tensor) -> int:
        self.seen.append(t)
        return t.untyped_storage()._cdata

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.nonzero.default:  # data-dependent: the loss's ignored tokens, none in a count
            out = torch.empty((0, args[0].dim()), dtype=torch.long, device=args[0].device)
            self.ops.append(_Op(False, {self.key(args[0]): _nbytes(args[0])}, {self.key(out): 0}))
            return out
        out = func(*args, **kwargs)
        if func in ALLOCATIONS or torch.Tag.inplace_view in func.tags:
            return out
        reads, writes = {}, {}
        for i, argument in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            written = argument.alias_info is not None and argument.alias_info.is_write
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    if written:
                        writes[self.key(t)] = _nbytes(t)
                    if not (written and argument.kwarg_only):  # an out= argument is only written
                        reads[self.key(t)] = max(reads.get(self.key(t), 0), _nbytes(t))
        inputs = set(reads) | set(writes)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and self.key(t) not in inputs:
                writes[self.key(t)] = _nbytes(t)
        if writes:  # an op whose outputs all alias its inputs (a view) moves nothing
            self.ops.append(_Op(func in MATMULS, reads, writes))
        return out


def _fused(ops: list[_Op], returned: set) -> OpaqueTraffic:
    """Matmuls alone, the ops between two matmuls as one kernel (see the module's docstring)."""
    groups, current = [], []
    for op in ops:
        if op.matmul:
            if current:
                groups.append(current)
            groups.append([op])
            current = []
        else:
            current.append(op)
    if current:
        groups.append(current)
    read = written = 0
    for k, group in enumerate(groups):
        later = set(returned)
        for other in groups[k + 1:]:
            for op in other:
                later |= op.reads.keys()
        produced, loaded = {}, set()
        for op in group:
            fresh = {s: n for s, n in op.reads.items() if s not in produced and s not in loaded}
            read += sum(fresh.values())
            loaded |= fresh.keys()
            produced.update(op.writes)
        written += sum(n for s, n in produced.items() if s in later)
    return OpaqueTraffic(read, written, len(groups))


_CACHE: dict = {}  # (op, argument shapes and values) -> OpaqueTraffic: the same op recurs in every layer


def _spec(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype)
    return repr(value)


def opaque_traffic(op: torch._ops.OpOverload, args, kwargs) -> OpaqueTraffic:
    """The traffic of `op` called on `args` (fake or real tensors: only their shapes, strides and
    dtypes are used), run as its CPU implementation on tensors of the meta device (a fresh fake
    mode per op crashed the garbage collector later, under pytest)."""
    key = (str(op), tuple(map(_spec, pytree.tree_leaves((args, kwargs)))))
    if key in _CACHE:
        return _CACHE[key]

    def fresh(value):
        if not isinstance(value, torch.Tensor):
            return value
        return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta")

    args, kwargs = pytree.tree_map(fresh, (args, kwargs))
    with _Recorder() as recorder:
        out = op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
    returned = {recorder.key(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
    _CACHE[key] = traffic = _fused(recorder.ops, returned)
    return traffic
