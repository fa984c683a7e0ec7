"""Planning with the cost model: predictions for a model and its inputs, the largest micro-batch
that fits a memory budget, the smallest peak checkpointing reaches, symbolic fits in B and T.

Predictions compile the step with `backend="eager"` and run nothing, so a model built under
`fake_mode()` (Llama-2-7B shapes on a laptop: no memory, no weights) is predicted exactly like
the real one. (A model on the meta device is not: attention then takes another kernel.)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

from picofx.cost.model import CostModel, StepMemory, bytes_moved, compute_rate, node_flops, optimizer_state_bytes
from picofx.cost.partition import inductor_recomputes, num_forward_outputs
from picofx.cost.symbolic import CHECK_BT, SIZES_BT, SymbolicStep, fit_samples
from picofx.cost.units import parse_budget
from picofx.errors import BudgetError, PassError
from picofx.manager import PASSES, PassInfo, PassResult, Stage, pass_info, resolve_passes
from picofx.api import optimize


def fake_mode():
    """`with fake_mode(): model = Llama(config); inputs = ...` builds a model and inputs that take
    no memory, for predictions."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@dataclass
class StepPrediction:
    memory: StepMemory
    seconds: float  # forward + backward on the cost model's device
    flops: int
    forward: fx.GraphModule
    backward: fx.GraphModule


def predict(model: nn.Module, example_inputs, *, loss_fn=None, passes=(), optimizer=None,
            cost_model=None, backend: str = "eager") -> StepPrediction:
    """Memory and time of one training step of `model` on `example_inputs`, after `passes`.
    backend="inductor" follows Inductor's generated code (fused kernels, their order, buffer
    reuse: `picofx.cost.inductor.kernel_order`) and, unless a pass plans the partition (`checkpoint`),
    Inductor's own min-cut partition (as `checkpoint` starts from it:
    `picofx.cost.partition.inductor_recomputes`); "eager" saves everything the backward reads."""
    cost_model = cost_model or CostModel.for_backend(_device_of(model), backend)
    passes = resolve_passes(passes)
    if cost_model.fuses_pointwise and not any(pass_info(p).plans_partition for p in passes):
        passes.append(InductorPartition())
    opt = optimize(model, example_inputs, passes, backend="eager", loss_fn=loss_fn, verify=None, cost_model=cost_model)
    fw, bw = opt.graphs["forward"], opt.graphs["backward"]
    memory = cost_model.step_memory(fw, bw, optimizer_state_bytes(optimizer, model.parameters()))
    return StepPrediction(memory, cost_model.graph_time(fw) + cost_model.graph_time(bw),
                          cost_model.graph_flops(fw) + cost_model.graph_flops(bw), fw, bw)


class InductorPartition:
    """Tags what Inductor's min-cut partition recomputes, so that an eager compile partitions the
    step as an Inductor compile without `checkpoint` does (the byte model's compiles too)."""

    info = PassInfo(Stage.JOINT, plans_partition=True, tags_only=True)

    def __call__(self, gm: fx.GraphModule, ctx) -> PassResult:
        recomputed = inductor_recomputes(gm, num_forward_outputs(gm))
        for node in recomputed:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        return PassResult(bool(recomputed), {"recomputed": len(recomputed)})


def _device_of(model: nn.Module) -> torch.device:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return torch.device("cpu") if device.type == "meta" else device


def resize_inputs(example_inputs, batch: int, seq: int | None = None):
    """The inputs with every tensor's dim 0 (batch) and, for 2-d and larger, dim 1 (sequence)
    tiled or cut to `batch` and `seq`: token ids and labels stay aligned."""
    def resize(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        sizes = [batch] + ([seq] if seq is not None and x.dim() >= 2 else [])
        for dim, size in enumerate(sizes):
            repeats = [1] * x.dim()
            repeats[dim] = -(-size // x.shape[dim])
            x = x.repeat(*repeats).narrow(dim, 0, size)
        return x.contiguous()

    return pytree.tree_map(resize, example_inputs)


def max_batch(model: nn.Module, budget, seq: int | None = None, *, example_inputs, loss_fn=None,
              passes=(), optimizer=None, cost_model=None, backend: str = "eager", limit: int = 1 << 16) -> int:
    """The largest micro-batch whose predicted step peak fits `budget` ("24GiB", bytes), at
    sequence length `seq` (default: that of `example_inputs`); 0 if not even batch 1 fits.

    Without passes (which may decide by size), each moment's live bytes are usually linear in the
    batch, so predictions at batch 2 and 3 give the peak at every batch; the answer is checked
    by a third prediction. Otherwise, or if the fit or the check fails, it doubles and bisects
    on full predictions."""
    budget = parse_budget(budget)
    cost_model = cost_model or CostModel.for_backend(_device_of(model), backend)

    def fits(b: int) -> bool:
        inputs = resize_inputs(example_inputs, b, seq)
        return predict(model, inputs, loss_fn=loss_fn, passes=passes, optimizer=optimizer,
                       cost_model=cost_model).memory.peak <= budget

    if not passes:
        try:
            step = fit_step(model, lambda b, t: resize_inputs(example_inputs, b, seq), loss_fn=loss_fn,
                            optimizer=optimizer, cost_model=cost_model, vary_seq=False)
        except ValueError:  # not linear in the batch (attention scratch, Inductor's buffer reuse)
            step = None
        guess = step.largest_batch(budget, limit) if step else None
        if guess == 0 or (guess and fits(guess)):
            return guess
    low, high = 0, 1  # fits(low) (0 by convention); grow high until it does not fit
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def fit_step(model, make_inputs: Callable[[int, int], object], *, sizes=None, check=None, loss_fn=None,
             passes=(), optimizer=None, cost_model=None, vary_seq: bool = True) -> SymbolicStep:
    """Predict the step at `sizes` ((B, T) pairs; `make_inputs(B, T)` builds the inputs) and fit
    sympy expressions in B and T (`picofx.cost.symbolic`). With `vary_seq=False` only B varies
    (two sizes, linear); `check` is one more size to verify."""
    sizes = sizes or (SIZES_BT if vary_seq else ((2, 0), (3, 0)))
    check = check if check is not None else (CHECK_BT if vary_seq else None)
    cost_model = cost_model or CostModel("cpu", attention_scratch=False)
    samples = []
    for b, t in [*sizes, *([check] if check else [])]:
        p = predict(model, make_inputs(b, t), loss_fn=loss_fn, passes=passes, optimizer=optimizer,
                    cost_model=cost_model)
        fw_t, bw_t = cost_model.timelines(p.forward, p.backward)
        nodes = [n for g in (p.forward, p.backward) for n in g.graph.nodes if n.op == "call_function"]
        samples.append({"shape": [str(n.target) for n in [*fw_t.nodes, *bw_t.nodes]],
                        "live": [*fw_t.live, *bw_t.live], "memory": p.memory,
                        "flops": [node_flops(n) for n in nodes], "moved": [bytes_moved(n) for n in nodes],
                        "peak_flops": [compute_rate(cost_model.device, n) for n in nodes]})
    return fit_samples(samples, sizes, check, vary_seq, cost_model)


def smallest_peak(model, example_inputs, *, loss_fn=None, backend: str = "eager", passes=()) -> int:
    """The smallest step peak (bytes) the `checkpoint` pass reaches on `model` after `passes`, as
    its error for an impossible budget reports it."""
    checkpoint = PASSES["checkpoint"](budget=1e-3)
    try:
        optimize(model, example_inputs, [*passes, checkpoint], backend=backend, loss_fn=loss_fn, verify=None)
    except PassError as e:
        if isinstance(e.__cause__, BudgetError):
            return e.__cause__.smallest_peak
        raise
    raise RuntimeError("a budget of 0.1% of the peak was met: the step has no activations to speak of")
