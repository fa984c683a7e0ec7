"""Helpers for pass tests: a captured graph in, assertions on the graph out, numerics against eager."""
from __future__ import annotations

import copy
from collections import Counter

import torch
from torch import fx

from picofx.capture.export import capture
from picofx.api import graph_inputs, optimize
from picofx.manager import Context, PassManager, Stage
from picofx.manager.verify import FP32_TOLERANCE
from picofx.capture.vocabulary import SIGNATURE_META


def op_counts(gm: fx.GraphModule) -> Counter:
    """How many call_function nodes call each target, keyed by the target's string (e.g. 'aten.mm.default')."""
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def count_ops(gm: fx.GraphModule, *targets) -> int:
    names = {str(t) for t in targets}
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in names)


def captured(zoo_model) -> tuple[fx.GraphModule, Context]:
    """A zoo model's captured forward graph and the forward-stage context its passes receive."""
    gm = capture(zoo_model.model, zoo_model.example_inputs, zoo_model.loss_fn)
    inputs = graph_inputs(gm.meta[SIGNATURE_META], zoo_model.model, (), dict(zoo_model.example_inputs))
    return gm, Context(model=zoo_model.model, example_inputs=inputs, device=inputs[0].device)


def run_pass(p, gm: fx.GraphModule, ctx: Context, verify: str = "numerics"):
    """Run one forward-stage pass through the manager (re-annotation, invariants, numerics);
    returns its PassRecord."""
    manager = PassManager([p], verify=verify)
    manager.run(Stage.FORWARD, gm, ctx)
    return manager.records[-1]


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _reference_call(zoo_model, model, batch):
    if zoo_model.loss_fn is None:
        return _loss(model(**batch))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return zoo_model.loss_fn(model(**inputs), batch["labels"])


def assert_trains_like_eager(zoo_model, passes, *, backend: str = "eager", batches=None,
                             tolerance=FP32_TOLERANCE, normwise: bool = False, **optimize_kwargs):
    """Optimize a copy of the zoo model and check, on each batch (default: the example inputs and one
    more of the same shape), that its loss and every parameter gradient equal the plain model's:
    element by element, or with `normwise` tensor by tensor, ||error|| <= rtol * ||expected|| + atol
    (for low precision, where one tensor's entries span orders of magnitude)."""
    reference = copy.deepcopy(zoo_model.model)
    opt = optimize(zoo_model.model, zoo_model.example_inputs, passes, backend=backend,
                   loss_fn=zoo_model.loss_fn, **optimize_kwargs)
    if batches is None:
        shifted = {k: v.roll(1, dims=-1) if isinstance(v, torch.Tensor) else v
                   for k, v in zoo_model.example_inputs.items()}
        batches = [zoo_model.example_inputs, shifted]
    rtol, atol = tolerance
    for batch in batches:
        for p in (*zoo_model.model.parameters(), *reference.parameters()):
            p.grad = None
        loss = _loss(opt(**batch))
        expected = _reference_call(zoo_model, reference, batch)
        loss.backward()
        expected.backward()
        close = _assert_close_normwise if normwise else torch.testing.assert_close
        close(loss, expected, rtol=rtol, atol=atol)
        for (name, p), ref in zip(zoo_model.model.named_parameters(), reference.parameters()):
            close(p.grad, ref.grad, rtol=rtol, atol=atol, msg=lambda m, name=name: f"gradient of {name}: {m}")
    return opt


def _assert_close_normwise(actual, expected, *, rtol: float, atol: float, msg=None):
    error = torch.linalg.vector_norm((actual - expected).double()).item()
    size = torch.linalg.vector_norm(expected.double()).item()
    if not error <= rtol * size + atol:  # also false for nan
        text = f"||error|| {error:.3g} is {error / max(size, 1e-30):.3g} of ||expected|| {size:.3g} (rtol {rtol:g})"
        raise AssertionError(msg(text) if msg else text)


def markov_batches(vocab_size: int, batch: int, seq: int, count: int, branching: int = 4, seed: int = 0) -> list[dict]:
    """`count` batches of a learnable language: each token is followed by one of `branching` fixed
    successors, chosen uniformly, so a model that learns the table reaches a loss of log(branching).
    Dicts of input_ids (B, T) and labels (B, T), the next tokens."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=generator)
    batches = []
    for _ in range(count):
        ids = torch.empty(batch, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab_size, (batch,), generator=generator)
        choices = torch.randint(0, branching, (batch, seq), generator=generator)
        for t in range(seq):
            ids[:, t + 1] = successors[ids[:, t], choices[:, t]]
        batches.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:].contiguous()})
    return batches


def train_losses(step_loss, parameters, batches, *, lr: float = 3e-3) -> list[float]:
    """Train with AdamW, one step per batch; `step_loss(batch)` returns the loss. Returns the losses."""
    optimizer = torch.optim.AdamW(parameters, lr=lr)
    losses = []
    for batch in batches:
        loss = step_loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
