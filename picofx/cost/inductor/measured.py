"""Ask Inductor itself: compile a schedule's graph with Inductor and measure its peak on the CPU.

The fallback of `InductorMemoryModel` where its mirrored rules cannot be vouched for. The
schedule's nodes (of a possibly larger joint graph) are copied into a graph of their own, whose
placeholders are the schedule's inputs and the values the caller holds; it is compiled by
`compile_fx_inner` (Inductor's compiler for an ATen graph, as aot_autograd calls it) and run once
on random inputs of the nodes' shapes and strides, under `peak_allocated_during`. Results are
kept per graph (code, input layouts and Inductor's config) for the process, at most `CACHED` of them.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
from torch import fx
from torch._inductor import config
from torch._subclasses.fake_tensor import unset_fake_temporarily

from picofx.cost.liveness import Schedule, storage_key, tensor_values
from picofx.cost.memory import peak_allocated_during

CACHED = 64
_peaks: OrderedDict = OrderedDict()


def schedule_graph(schedule: Schedule, held=()) -> fx.GraphModule:
    """The schedule as a GraphModule of its own: inputs (then `held`) as placeholders, steps in
    order, the outputs (and `held`, which the caller keeps alive) returned."""
    graph, env, root = fx.Graph(), {}, torch.nn.Module()
    for node in [*schedule.inputs, *held]:
        if node not in env:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
    for node in schedule.steps:
        if node.op == "get_attr":
            setattr(root, node.target, getattr(node.graph.owning_module, node.target))
        env[node] = graph.node_copy(node, env.__getitem__)
    returned = [env[n] for n in [*schedule.outputs, *held] if n is not None]
    graph.output(tuple(returned))
    return fx.GraphModule(root, graph)


def _random_like(value: torch.Tensor) -> torch.Tensor:
    real = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype)
    return real.normal_() if value.dtype.is_floating_point else real.zero_()


def measured_peak(schedule: Schedule, resident: set, *, frees_inputs: bool = True, held=()) -> int:
    """Peak bytes live while Inductor's code for the schedule runs, not counting `resident`
    storages, counting the schedule's other inputs from the start (freed after their last use
    when `frees_inputs`)."""
    gm = schedule_graph(schedule, held)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("val") for n in placeholders]
    key = (gm.code, tuple((tuple(v.shape), tuple(v.stride()), v.dtype) if isinstance(v, torch.Tensor) else repr(v)
                          for v in values), frees_inputs, tuple(storage_key(v) in resident for v in tensor_values(values)),
           repr(sorted(config.get_config_copy().items())))
    if key in _peaks:
        _peaks.move_to_end(key)
        return _peaks[key]
    with warnings.catch_warnings():  # its first import loads torch.utils.mkldnn, which uses torch.jit
        warnings.filterwarnings("ignore", message=r"`torch.jit.script_method` is deprecated", category=DeprecationWarning)
        from torch._inductor.compile_fx import compile_fx_inner

    with unset_fake_temporarily():
        inputs = [_random_like(v) if isinstance(v, torch.Tensor) else v for v in values]
        counted = {i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and storage_key(v) not in resident}
        compiled = compile_fx_inner(gm, inputs)
        start = sum(inputs[i].untyped_storage().nbytes() for i in counted)
        args = list(inputs)
        if frees_inputs:  # only the compiled code holds the counted inputs, and frees them after their last use
            inputs = [None if i in counted else x for i, x in enumerate(inputs)]
        with torch.no_grad():
            peak = start + peak_allocated_during(lambda: compiled(args))
    _peaks[key] = peak
    if len(_peaks) > CACHED:
        _peaks.popitem(last=False)
    return peak
