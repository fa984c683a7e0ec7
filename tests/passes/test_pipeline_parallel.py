"""Pass `pipeline` with tensor-parallel stages: sequence parallelism across the cut (pp 2 x tp 2,
4 gloo ranks) and replicated data parallelism over the stages (pp 2 x dp_replicate 2 x tp 2, 8
ranks), each against one process: losses rtol 1e-5, the first step's gathered gradients rtol 1e-4
(DESIGN §9). After two AdamW steps each parameter's change is compared normwise, rtol 1e-3: AdamW's
first step moves every element by about lr whatever its gradient's size, so an element whose
gradient is at float noise (1e-4 of the gradients) moves by about lr either way."""
from __future__ import annotations

import warnings

import pytest
import torch

from picofx.models import real_models, zoo

import pipeline_parallel_ranks
from spawn_ranks import run_ranks

LOSS = dict(rtol=1e-5, atol=1e-7)
GRAD = dict(rtol=1e-4, atol=1e-6)
UPDATE_RTOL = 1e-3


def one_process(batch: int) -> dict:
    """The same AdamW steps as the ranks take, on the whole model and batch."""
    z = zoo.build("llama-tiny", batch=batch, seq=16)
    initial = {n: p.detach().clone() for n, p in z.model.named_parameters()}
    optimizer = torch.optim.AdamW(z.model.parameters(), lr=pipeline_parallel_ranks.LR)
    losses, grads = [], None
    for _ in range(pipeline_parallel_ranks.STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = z.loss_fn(z.model(z.example_inputs["input_ids"]), z.example_inputs["labels"])
        loss.backward()
        losses.append(loss.detach())
        grads = grads or {n: p.grad.clone() for n, p in z.model.named_parameters()}
        optimizer.step()
    return {"losses": losses, "grads": grads, "initial": initial,
            "parameters": {n: p.detach() for n, p in z.model.named_parameters()}}


def assert_trained_as(parameters: dict, expected: dict) -> None:
    """Each parameter's change over the steps equals one process's, normwise (see the docstring)."""
    for name, value in parameters.items():
        start = expected["initial"][name]
        change, expected_change = value - start, expected["parameters"][name] - start
        error = (change - expected_change).norm() / expected_change.norm()
        assert error <= UPDATE_RTOL, f"{name}: its change differs from one process's by {error:.2e} of its norm"


def assert_stages_equal(ranks: list, expected: dict) -> None:
    """Every rank's gradients and trained parameters equal one process's; together the ranks hold
    every parameter."""
    held = set()
    for rank in ranks:
        for name, grad in rank["grads"].items():
            torch.testing.assert_close(grad, expected["grads"][name], **GRAD, msg=lambda m, n=name: f"{n}: {m}")
        assert_trained_as(rank["parameters"], expected)
        held |= set(rank["grads"])
    assert held == set(expected["grads"])


@pytest.mark.slow
def test_sequence_parallel_stages_send_sequence_shards_and_equal_one_process(tmp_path):
    import torch.distributed.checkpoint as dcp

    ranks = run_ranks(pipeline_parallel_ranks.sequence_parallel, 4, str(tmp_path), timeout=900,
                      collective_timeout=600)
    expected = one_process(batch=4)
    for rank in ranks:
        torch.testing.assert_close(torch.stack(rank["losses"]), torch.stack(expected["losses"]), **LOSS)
    assert_stages_equal(ranks, expected)
    for rank in ranks:  # sequence parallelism without async TP's chunks: one step
        torch.testing.assert_close(rank["unchunked"]["loss"], expected["losses"][0], **LOSS)
        for name, grad in rank["unchunked"]["grads"].items():
            torch.testing.assert_close(grad, expected["grads"][name], **GRAD, msg=lambda m, n=name: f"{n}: {m}")
    tied = real_models.hf_model("llama", tie_word_embeddings=True)
    tied.model(**tied.example_inputs).loss.backward()
    for rank in ranks:  # the tied parameter's gradient: its stages' vocabulary pieces summed
        assert "model.embed_tokens.weight" in rank["tied"]["grads"]
        for name, grad in rank["tied"]["grads"].items():
            torch.testing.assert_close(grad, tied.model.get_parameter(name).grad, **GRAD, msg=name)
    # the later stage receives each tp rank's half of the sequence: (micro-batch 2, 16 / 2, hidden)
    hidden = expected["parameters"]["embedding.weight"].shape[1]
    received = [shapes for rank in ranks for index, shapes in rank["received"].items() if index == 1]
    assert received == [[[2, 8, hidden]]] * 2
    plain = zoo.build("llama-tiny", seed=1).model
    state = plain.state_dict()
    with warnings.catch_warnings():  # torch warns that it loads in one process, which is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    plain.load_state_dict(state, strict=True)
    assert_trained_as({n: p.detach() for n, p in plain.named_parameters()}, expected)


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["after the schedule", "overlap"])
def test_replicas_of_tensor_parallel_stages_average_their_gradients_and_equal_one_process(exchange):
    ranks = run_ranks(pipeline_parallel_ranks.replicated, 8, exchange == "overlap", timeout=900,
                      collective_timeout=600)
    expected = one_process(batch=8)
    # ranks 0 and 2 hold stage 0's first tp piece in replicas 0 and 1 (mesh pp x dp_replicate x tp)
    for step, loss in enumerate(expected["losses"]):
        torch.testing.assert_close((ranks[0]["losses"][step] + ranks[2]["losses"][step]) / 2, loss, **LOSS)
    assert_stages_equal(ranks, expected)
