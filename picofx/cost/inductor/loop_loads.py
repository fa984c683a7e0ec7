"""How an Inductor loop kernel loads the buffers it reads, in the form Inductor compares loads in.

Inductor fuses two kernels for a buffer they both read only when they load it alike: the same
memory dependency, an index expression over the same loop ranges, after each kernel has merged
the loop dims its indexing lets it merge (`SchedulerNode` simplifies its loops before fusion).
A load is given here as (sizes, strides, storage offset) of the value loaded, broadcast to the
kernel's loop, with size-1 dims dropped and adjacent dims merged where the strides allow. Two
loads of a contiguous buffer from loops of any shape compare equal; a buffer read through a
broadcast (a RoPE table over heads) compares equal only from a loop that repeats it the same way.
"""
from __future__ import annotations

import math

import torch
from torch import fx

from picofx.cost.inductor.fused_buffers import REDUCTIONS
from picofx.cost.liveness import tensor_values

RESHAPES = {torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}
Load = tuple  # (sizes, strides, offset), or None where views past an inlined value hide the index


def output_size(node: fx.Node) -> int:
    """Elements of the node's (first) value."""
    values = tensor_values(node.meta.get("val"))
    return math.prod(values[0].shape) if values else 0


def load_key(value: torch.Tensor, loop_shape, order=None) -> Load:
    """The load of `value` from a loop over `loop_shape`, its dims run in `order` (a reduction
    runs its kept dims outside the reduced ones)."""
    if value.dim() > len(loop_shape):
        return None
    pad = len(loop_shape) - value.dim()
    dims = []
    for i, n in enumerate(loop_shape):
        j = i - pad
        if j >= 0 and value.shape[j] not in (1, n):
            return None
        dims.append((n, value.stride(j) if j >= 0 and value.shape[j] == n else 0))
    sizes, strides = [], []
    for n, stride in (dims[i] for i in (order or range(len(dims)))):
        if n == 1:
            continue
        if sizes and strides[-1] == stride * n:
            sizes[-1], strides[-1] = sizes[-1] * n, stride
        else:
            sizes.append(n)
            strides.append(stride)
    return tuple(sizes), tuple(strides), value.storage_offset()


def loop_order(node: fx.Node, loop_shape) -> tuple:
    """The order a kernel runs its loop dims in: a reduction's kept dims, then its reduced ones."""
    rank = len(loop_shape)
    dims = node.args[1] if len(node.args) > 1 and not isinstance(node.args[1], bool) else node.kwargs.get("dim")
    if node.target not in REDUCTIONS or dims is None or dims == [] or not rank:
        return tuple(range(rank))
    reduced = {d % rank for d in ([dims] if isinstance(dims, int) else dims)}
    return (*(d for d in range(rank) if d not in reduced), *sorted(reduced))


def loads(node: fx.Node, loop_shape, transparent, views, order=None, memo=None) -> dict[fx.Node, set]:
    """The buffers `node`'s kernel (looping over `loop_shape`, in `order`) loads, each with its
    loads. `transparent`: nodes that are no kernel of their own (inlined values and views);
    `views`: those that are views. An inlined value is computed inside the loop: its loads are
    taken as strided tensors over the buffer in its own index space (meta tensors), and the
    views between it and its reader are replayed on them; a view that would copy gives None.
    `memo` keeps what each inlined value loads, for other kernels that inline it too."""
    seen = _seen(node, transparent, views, {} if memo is None else memo)
    return {buffer: {load_key(t, loop_shape, order) if t is not None else None for t in ts}
            for buffer, ts in seen.items()}


def _seen(node: fx.Node, transparent, views, memo: dict) -> dict[fx.Node, list]:
    """Per buffer, the tensors through which `node` (a kernel or an inlined value) loads it."""
    if node in memo:
        return memo[node]
    found: dict[fx.Node, dict] = {}
    for arg in node.all_input_nodes:
        chain = []
        source = arg
        while source in views:
            chain.append(source)
            source = source.args[0]
        if source not in transparent:
            value = tensor_values(arg.meta.get("val"))
            _add(found, source, _meta(value[0]) if value else None)
            continue
        shape = tensor_values(source.meta.get("val"))[0].shape
        for buffer, seen in _seen(source, transparent, views, memo).items():
            for t in seen:
                _add(found, buffer, _replay(_broadcast(t, shape), reversed(chain)))
    memo[node] = {buffer: list(ts.values()) for buffer, ts in found.items()}
    return memo[node]


def _add(found: dict, buffer: fx.Node, t: torch.Tensor | None) -> None:
    key = None if t is None else (tuple(t.shape), t.stride(), t.storage_offset())
    found.setdefault(buffer, {})[key] = t


def _broadcast(t: torch.Tensor | None, shape) -> torch.Tensor | None:
    try:
        return t.expand(shape) if t is not None else None
    except (RuntimeError, ValueError):
        return None


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device="meta").as_strided(t.shape, t.stride(), t.storage_offset())


def _replay(t: torch.Tensor | None, chain) -> torch.Tensor | None:
    """`t` through the views of `chain` (reshapes only where no copy is needed)."""
    for view in chain:
        if t is None:
            return None
        target = torch.ops.aten.view.default if view.target in RESHAPES else view.target
        try:
            t = target(t, *view.args[1:], **view.kwargs)
        except (RuntimeError, ValueError, IndexError, TypeError):  # the view would copy, or does not apply
            return None
    return t if isinstance(t, torch.Tensor) else None


class LoopAccess:
    """How each of `loops` (loop kernels, whose loop shapes `shape_of` gives) accesses its buffers."""

    def __init__(self, loops, shape_of, transparent, views):
        self.order, self.reads, self.writes, self.size = {}, {}, {}, {}
        memo: dict = {}
        for node in loops:
            shape = shape_of(node)
            self.order[node] = loop_order(node, shape)
            self.reads[node] = loads(node, shape, transparent, views, self.order[node], memo)
            value = tensor_values(node.meta.get("val"))
            self.writes[node] = {load_key(value[0], value[0].shape)} if value else {None}
            self.size[node] = math.prod(shape)

    def row_wise(self, node: fx.Node) -> bool:
        """False for a reduction over outer dims: it walks its input column by column."""
        return self.order[node] == tuple(sorted(self.order[node]))

    def alike(self, a: fx.Node, b: fx.Node, buffer: fx.Node) -> bool:
        """Whether a (which may write `buffer`) and b access `buffer` alike. Where a view that
        would copy hides how one of them loads it: alike for a buffer read whole by row-wise
        loops, unlike for a broadcast (a smaller buffer) or a column walk."""
        ours, theirs = self.writes[a] if buffer is a else self.reads[a][buffer], self.reads[b][buffer]
        if (ours & theirs) - {None}:
            return True
        whole = output_size(buffer) >= self.size[a]
        return None in ours | theirs and whole and self.row_wise(a) and self.row_wise(b)

    def elements_read(self, buffers) -> dict:
        """(loop, one of `buffers`) -> how many elements the loop's index into it covers: the loop
        dims the index uses (`torch._inductor.dependencies.MemoryDep.get_numel`), none of a
        broadcast's; a load through a view that needs floor division uses all of them."""
        buffers = set(buffers)
        return {(node, buffer): max(self.size[node] if load is None else
                                    math.prod(n for n, stride in zip(*load[:2]) if stride) for load in loads)
                for node, reads in self.reads.items() for buffer, loads in reads.items() if buffer in buffers}
