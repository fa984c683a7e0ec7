"""Shard + tensor parallelism with sequence parallelism + a pipeline (pp 2 x dp_shard 2 x tp 2, the
4-D layout of the largest published runs, on 8 gloo ranks): one training step equals one process on
the full batch, and every rank of a stage issues its collectives in one order (a rank whose order
differs from its group's waits for ever: the fault that kept this layout refused). Cheap: picofx
train and the planner's recipe accept the layout."""
from __future__ import annotations

import pytest
import torch

import shard_sequence_pipeline_ranks as ranks_of
from picofx.cli.train_args import parse_args
from picofx.planner.recipe import refusal
from picofx.planner.spec import parse_layout
from spawn_ranks import run_ranks

LAYOUT = "dp_shard=2,tp=2,sequence_parallel=true,pp=2,microbatches=4"


def test_the_recipe_and_picofx_train_accept_shard_with_sequence_parallel_pipeline_stages():
    assert refusal(parse_layout(LAYOUT)) is None
    assert refusal(parse_layout(LAYOUT + ",async_tp=false")) is None
    args = parse_args(["--shard", "--tp", "2", "--sequence-parallel", "--pp", "2", "--microbatches", "4",
                       "--no-measure-cuts"], environ={"RANK": "0", "WORLD_SIZE": "8"})
    assert (args.world, args.tp, args.pp, args.shard, args.sequence_parallel) == (8, 2, 2, True, True)


@pytest.mark.slow
def test_shard_with_sequence_parallel_pipeline_stages_equals_one_process_on_8_ranks():
    ranks = run_ranks(ranks_of.step, 8, timeout=900, collective_timeout=300)
    for stage in (0, 1):  # its 4 ranks: 2 tp groups, 2 dp_shard groups, one order of collectives
        issued = [r["issued"] for r in ranks if r["stage"] == stage]
        assert issued[0] and all(i == issued[0] for i in issued), (stage, issued)
        kinds = {c.split("@")[1] for seq in issued[0].values() for c in seq}
        assert {"tp", "dp_shard"} <= kinds, kinds  # sequence parallelism's and shard's both ran there
    expected = ranks_of.one_process()
    losses = {r["replica"]: r["loss"] for r in ranks}  # every rank of a replica holds its loss
    for r in ranks:
        torch.testing.assert_close(r["loss"], losses[r["replica"]], rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.stack([losses[0], losses[1]]).mean(), expected["loss"], rtol=1e-5, atol=1e-6)
    held = {name for r in ranks for name in r["grads"]}
    assert held == set(expected["grads"]), sorted(held ^ set(expected["grads"]))
    for r in ranks:
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, expected["grads"][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
