"""Pass `checkpoint` with float8 linears: the float8 cast of each weight that the backward makes again is
a choice the pass prices (save its 1 byte per element, or recompute the cast from the weight), and
either way the loss and gradients are those of the step without checkpointing."""
import copy
import warnings

import pytest
import torch

import picofx
from picofx.models import zoo
from picofx.passes import Checkpoint, Precision

FLOAT8_LINEARS = 15  # llama-tiny: 7 per decoder layer and the output projection


def amaxes(gm) -> int:
    return sum(n.target is torch.ops.aten.amax.default for n in gm.graph.nodes)


@pytest.fixture(scope="module")
def steps():
    """llama-tiny with every linear in float8 (tensorwise): without checkpointing, with it and no budget
    to meet, and at 85% of the peak without recomputation: (loss, gradients, backward graph, notes) each."""
    z = zoo.build("llama-tiny")
    return {name: float8_step(z, extra, "eager")
            for name, extra in (("plain", []), ("loose", [Checkpoint()]), ("tight", [Checkpoint(budget=0.85)]))}


def float8_step(z, extra: list, backend: str):
    """One step of `z` with every linear in float8 (tensorwise) and the passes `extra`: (loss,
    gradients, backward graph, the checkpoint pass's notes)."""
    model = copy.deepcopy(z.model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Precision\(float8=...\) on the CPU")
        opt = picofx.optimize(model, z.example_inputs, [Precision(float8="tensorwise", float8_layers="all"), *extra],
                              backend=backend, loss_fn=z.loss_fn)
    loss = opt(**z.example_inputs)
    loss.backward()
    notes = next((r.notes for r in opt.report.records if r.name == "checkpoint"), {})
    return loss.detach(), [p.grad for p in model.parameters()], opt.graphs["backward"], notes


def test_with_room_the_float8_weights_are_saved_and_the_backward_casts_no_weight(steps):
    *_, plain_backward, _ = steps["plain"]
    *_, backward, notes = steps["loose"]
    weights = notes["float8_weights"]
    assert len(weights["saved"]) == FLOAT8_LINEARS and not weights["recomputed"]
    assert weights["saved_bytes"] == sum(p.numel() for n, p in zoo.build("llama-tiny").model.named_parameters()
                                         if p.dim() == 2 and "embed" not in n)
    # the backward no longer takes each weight's amax: one reduction fewer per float8 linear
    assert amaxes(backward) == amaxes(plain_backward) - FLOAT8_LINEARS


def test_under_a_tight_budget_some_weight_casts_are_recomputed_within_it(steps):
    *_, notes = steps["tight"]
    weights = notes["float8_weights"]
    assert weights["recomputed"] and len(weights["saved"]) < FLOAT8_LINEARS
    assert notes["peak_after"] <= notes["budget"] < notes["peak_before"]


@pytest.mark.parametrize("plan", ["loose", "tight"])
def test_the_loss_and_gradients_equal_the_step_without_checkpointing(steps, plan):
    loss, grads, *_ = steps[plan]
    plain_loss, plain_grads, *_ = steps["plain"]
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    for got, expected in zip(grads, plain_grads):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_under_inductor_the_float8_weights_are_offered_too_and_numerics_hold():
    """Inductor's joint graph casts with prims.convert_element_type: the casts are offered all the same."""
    z = zoo.build("llama-tiny")
    (plain_loss, plain_grads, *_), (loss, grads, _, notes) = (float8_step(z, extra, "inductor")
                                                              for extra in ([], [Checkpoint()]))
    assert len(notes["float8_weights"]["saved"]) == FLOAT8_LINEARS
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=0)
    for got, expected in zip(grads, plain_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
