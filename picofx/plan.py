"""Planning with the cost model: budgets, predictions for a model and its inputs, the largest
micro-batch that fits a memory budget.

Predictions compile the step with `backend="eager"` and run nothing, so a model built under
`fake_mode()` (Llama-2-7B shapes on a laptop: no memory, no weights) is predicted exactly like
the real one. (A model on the meta device is not: attention then takes another kernel.)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

from picofx.cost_model import CostModel, StepMemory, optimizer_state_bytes
from picofx.partition import inductor_recomputes, num_forward_outputs
from picofx.pass_manager import PassResult, Stage

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class BudgetError(ValueError):
    """A memory budget cannot be met; the message says the smallest achievable peak and what fits.
    `smallest_peak` (bytes) and `batch_that_fits` (or None) say it as numbers."""

    def __init__(self, message: str, smallest_peak: int | None = None, batch_that_fits: int | None = None):
        super().__init__(message)
        self.smallest_peak, self.batch_that_fits = smallest_peak, batch_that_fits


def parse_budget(budget, reference: int | None = None) -> int:
    """Bytes from an int (bytes), a string ("8GiB", "512MiB", "1.5GB", "1e9") or a float, which is
    a fraction of `reference` (the predicted peak without checkpointing)."""
    if isinstance(budget, bool):
        raise TypeError("a budget is bytes (int), a size string or a fraction (float), not a bool")
    if isinstance(budget, int):
        value = budget
    elif isinstance(budget, float):
        if reference is None:
            raise ValueError(f"budget {budget} is a fraction, but there is no reference peak to take it of")
        value = int(budget * reference)
    elif isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", budget)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read budget {budget!r}: write bytes with a unit, e.g. '8GiB', '512MiB', "
                             "'1.5GB', or pass an int (bytes) or a float (fraction of the peak)")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise TypeError(f"a budget is bytes (int), a size string or a fraction (float), got {budget!r}")
    if value <= 0:
        raise ValueError(f"budget must be positive, got {budget!r}")
    return value


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
    reuse: `picofx.kernel_order`) and, unless a pass plans the partition (`checkpoint`),
    Inductor's own min-cut partition (as `checkpoint` starts from it:
    `picofx.partition.inductor_recomputes`); "eager" saves everything the backward reads."""
    from picofx.optimize import optimize

    cost_model = cost_model or CostModel.for_backend(_device_of(model), backend)
    passes = list(passes)
    if cost_model.fuses_pointwise and not any(getattr(p, "plans_partition", False) for p in passes):
        passes.append(_InductorPartition())
    opt = optimize(model, example_inputs, passes, backend="eager", loss_fn=loss_fn, verify=None, cost_model=cost_model)
    fw, bw = opt.graphs["forward"], opt.graphs["backward"]
    memory = cost_model.step_memory(fw, bw, optimizer_state_bytes(optimizer, model.parameters()))
    return StepPrediction(memory, cost_model.graph_time(fw) + cost_model.graph_time(bw),
                          cost_model.graph_flops(fw) + cost_model.graph_flops(bw), fw, bw)


class _InductorPartition:
    """Tags what Inductor's min-cut partition recomputes, so that an eager compile partitions the
    step as an Inductor compile without `checkpoint` does."""

    stage = Stage.JOINT
    plans_partition = True

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
    from picofx.symbolic import fit_step

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
