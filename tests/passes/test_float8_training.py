"""Pass `precision` with float8 in training: against torchao's float8 training of the same model and
recipe (with and without `fuse`), and against bf16 over many steps."""
import copy
import warnings

import pytest
from float8_reference import autocast_step, picofx_step, torchao_model

import picofx
from picofx.models import zoo
from picofx.passes import Precision
from picofx.testing import markov_batches, train_losses


def picofx_losses(z, batches, passes):
    model = copy.deepcopy(z.model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Precision\(float8=...\) on the CPU")
        opt = picofx.optimize(model, batches[0], passes, backend="eager", loss_fn=z.loss_fn)
    return train_losses(picofx_step(z, opt), model.parameters(), batches)


def torchao_losses(z, batches, recipe, fuse):
    # fuse's linear + cross-entropy keeps the output projection in bf16: torchao leaves it too
    model = torchao_model(z.model, recipe, exclude=("final_proj",) if fuse else ())
    return train_losses(autocast_step(z, model), model.parameters(), batches)


def final(losses, last=10):
    return sum(losses[-last:]) / last


def check_against_torchao(steps, recipe, fuse, last):
    z = zoo.reference_llama("tiny", batch=8, seq=32)
    batches = markov_batches(256, 8, 32, steps)
    passes = (["fuse"] if fuse else []) + [Precision(float8=recipe, float8_layers="all")]
    ours, theirs = final(picofx_losses(z, batches, passes), last), final(torchao_losses(z, batches, recipe, fuse), last)
    assert abs(ours - theirs) < 0.01 * theirs, (steps, recipe, fuse, ours, theirs)
    return ours


def test_ten_steps_with_fuse_end_within_1_percent_of_torchao():
    check_against_torchao(10, "tensorwise", fuse=True, last=3)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, fuse", [("tensorwise", False), ("tensorwise", True), ("rowwise", False),
                                          ("rowwise_with_gw_hp", True)])
def test_fifty_steps_end_within_1_percent_of_torchao(recipe, fuse):
    check_against_torchao(50, recipe, fuse, last=10)


@pytest.mark.slow
def test_200_steps_end_within_2_percent_of_bf16():
    z = zoo.reference_llama("tiny", batch=8, seq=32)
    batches = markov_batches(256, 8, 32, 200)
    float8 = final(picofx_losses(z, batches, [Precision(float8="tensorwise", float8_layers="all")]))
    bf16 = final(picofx_losses(z, batches, ["precision"]))
    assert bf16 < 2.5, bf16  # it learned (from log(256) = 5.55): the comparison means something
    assert abs(float8 - bf16) < 0.02 * bf16, (float8, bf16)
