"""Measure a compiled step and let the passes that plan memory re-plan with what was measured.

A pass that asks for it (`measure` true, as `Checkpoint(measure=True)`) gets, after compilation,
the peak of one real training step: `after_measured_step(record, measured_peak)` sees its own
record of this compilation and returns the pass to run instead (compilation then starts over
from the same forward graph), or None when the plan stands. At most `MAX_REPLANS` re-plans.

The step runs on the model's own parameters; gradients, buffers and the random number
generators are restored afterwards, so the measurement leaves no trace. The peak is
`picofx.cost.memory.measure_peak`'s: live tensor bytes on the CPU, `torch.cuda.max_memory_allocated`
on a GPU, counting the parameters, buffers and inputs.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from picofx.cost.memory import measure_peak
from picofx.manager import PassManager, copy_graph
from picofx.manager.passes import pass_name

MAX_REPLANS = 2


def measuring_passes(manager: PassManager) -> list:
    return manager.declared("replans")


def training_loss(output) -> torch.Tensor:
    """The loss in a step's output: the output itself, its `.loss`, or its first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "loss", None) is not None:
        return output.loss
    return next(t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor))


def measure_step_peak(step: Callable[[], object], model: nn.Module, inputs) -> int:
    """Peak bytes of one call of `step` (its forward) and the backward of its loss, after one
    call to warm up; the model's gradients, buffers and random state are left as they were."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda = any(p.is_cuda for p in params)
    rng = torch.random.get_rng_state(), (torch.cuda.get_rng_state_all() if cuda else None)

    def run():
        for p in params:
            p.grad = None
        training_loss(step()).backward()

    try:
        run()
        for p in params:
            p.grad = None
        return measure_peak(run, resident=(model, inputs))
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for p, g in zip(params, grads):
            p.grad = g
        torch.random.set_rng_state(rng[0])
        if cuda:
            torch.cuda.set_rng_state_all(rng[1])


def compile_measured(forward: fx.GraphModule, compile_graph: Callable[[fx.GraphModule], object],
                     manager: PassManager, peak_of: Callable[[object], int]):
    """`compile_graph(forward)` until the measuring passes accept the measured peak
    (`peak_of(compiled)`); a re-plan compiles a fresh copy of `forward` as it was before the first
    round (compilation rewrites the graph it is given). The manager keeps the records of the last
    compilation only."""
    pristine = fx.GraphModule(forward, copy_graph(forward.graph))
    for round_ in range(MAX_REPLANS + 1):
        first = len(manager.records)
        gm = forward if round_ == 0 else fx.GraphModule(pristine, copy_graph(pristine.graph))
        gm.meta.update(forward.meta)
        compiled = compile_graph(gm)
        passes = measuring_passes(manager)
        if not passes:
            return compiled
        peak = peak_of(compiled)
        replaced = False
        for p in passes:
            record = next((r for r in reversed(manager.records[first:]) if r.name == pass_name(p)), None)
            if record is None:
                continue
            new = p.after_measured_step(record, peak)
            if new is not None and round_ < MAX_REPLANS:
                manager.passes[manager.passes.index(p)] = new
                replaced = True
        if not replaced:
            return compiled
        del manager.records[first:]
    return compiled
