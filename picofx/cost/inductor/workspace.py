"""Scratch memory that an op's kernel allocates beyond its outputs, measured once per shape.

ATen ops in picofx's graphs are decomposed far enough that their temporaries are graph values
the liveness simulation already counts, except attention. Attention kernels and custom ops
(the fused kernels in picofx.kernels) are single nodes whose kernels may allocate internally
(fp32 accumulators, chunk buffers). For those the
cost model runs the op once on random inputs of the node's shapes, on the CPU, and takes the
peak it allocates minus the bytes of its outputs. Inputs larger than `limit` bytes are not
materialised; such nodes count as having no scratch memory.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from picofx.capture.annotate import tensor_bytes
from picofx.cost.liveness import tensor_values
from picofx.cost.memory import peak_allocated_during

# Scratch bytes by (op, input shapes, strides and dtypes, constants): a few dozen keys per model.
# Bounded for long runs over many shapes: past MEASUREMENTS_KEPT the oldest measurement goes.
MEASUREMENTS_KEPT = 1024
_cache: dict[tuple, int] = {}


def _allocates_scratch(node: fx.Node, attention: bool) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or _communicates(target):
        return False
    return target.namespace not in ("aten", "prims") or (attention and target.name().startswith("aten::_scaled_dot_product"))


def _communicates(op: torch._ops.OpOverload) -> bool:
    """A collective, or an op that runs one (it names a process group): run here, on one rank
    alone, it would wait for peers that never join it, or leave its work unwaited at exit."""
    return op.namespace.startswith(("_c10d", "c10d")) or any(
        a.name in ("group", "group_name") for a in op._schema.arguments)


def _real(value):
    """A CPU tensor of `value`'s shape, strides and dtype: kernels copy inputs whose layout they
    do not take, so the layout changes the scratch they allocate."""
    if not isinstance(value, torch.Tensor):
        return value
    # Filled flat, then viewed: strides may overlap (a broadcast k/v head has stride 0), and torch
    # refuses to write through such a view.
    extent = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()) if size)
    flat = torch.empty(extent if value.numel() else 0, dtype=value.dtype)
    flat = _fill_random(flat) if value.dtype.is_floating_point else flat.zero_()  # indices, labels: 0 is valid
    return flat.as_strided(tuple(value.shape), tuple(value.stride()))


NOISE_PERIOD = 1 << 20
_noise: dict[torch.dtype, torch.Tensor] = {}  # NOISE_PERIOD normal values per dtype, drawn once


def _fill_random(flat: torch.Tensor) -> torch.Tensor:
    """`flat` filled with normal values repeating every NOISE_PERIOD: drawing them all took longer
    than the kernels measured (3 of 10 s for Llama-2-7B's at 4,096 tokens), copying is cheap."""
    if flat.dtype not in _noise:
        _noise[flat.dtype] = torch.empty(NOISE_PERIOD, dtype=flat.dtype).normal_()
    noise, whole = _noise[flat.dtype], flat.numel() // NOISE_PERIOD * NOISE_PERIOD
    flat[:whole].view(-1, NOISE_PERIOD).copy_(noise)
    flat[whole:].copy_(noise[:flat.numel() - whole])
    return flat


def _arg(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def workspace_bytes(node: fx.Node, limit: int = 256 * 2**20, attention: bool = True) -> int:
    """Bytes the node's kernel holds at its peak beyond its outputs (0 for decomposed ATen ops,
    and for kernels that cannot run on the CPU)."""
    if node.op != "call_function" or not _allocates_scratch(node, attention):
        return 0
    args = fx.node.map_aggregate(node.args, _arg)
    kwargs = fx.node.map_aggregate(node.kwargs, _arg)
    inputs = tensor_values((args, kwargs))
    key = (node.target, tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in inputs),
           repr([a for a in pytree.tree_leaves((args, kwargs)) if not isinstance(a, torch.Tensor)]))
    if key not in _cache:
        if len(_cache) >= MEASUREMENTS_KEPT:
            del _cache[next(iter(_cache))]
        if tensor_bytes(inputs) > limit:
            _cache[key] = 0
        else:
            outputs = tensor_bytes(node.meta.get("val"))
            with torch.no_grad(), unset_fake_temporarily():
                real_args = pytree.tree_map(_real, args)
                real_kwargs = pytree.tree_map(_real, kwargs)
                try:
                    peak = peak_allocated_during(lambda: node.target(*real_args, **real_kwargs))
                except (RuntimeError, NotImplementedError):  # a GPU-only kernel
                    peak = outputs
            _cache[key] = max(peak - outputs, 0)
    return _cache[key]
