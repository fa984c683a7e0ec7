"""picofx.plan(model, world=N, ...): `picofx plan`'s ranking in Python, and the passes and mesh of a plan
that picofx.optimize runs."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import picofx
from picofx.models.llama import CONFIGS, Llama, causal_lm_loss
from picofx.cli.train_layout import unrunnable
from picofx.planner import plan_run
from picofx.planner.layouts import Layout

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "passes"))  # the rank harness, beside the pass tests
from spawn_ranks import run_ranks  # noqa: E402

GLOO = {"link_bandwidth": 1e9, "link_latency": 1e-4, "network_bandwidth": 1e9, "network_latency": 1e-4,
        "link_name": "gloo, given", "network_name": "gloo, given", "link_source": "given"}


@pytest.fixture(scope="module")
def tiny_plans():
    return picofx.plan("llama-tiny", world=4, seq=32, global_batch=8, gpu="h100")


def test_plan_ranks_as_the_command_does_and_stays_a_module(tiny_plans):
    _, predictions = plan_run("llama-tiny", gpus=4, gpu="h100", seq=32, global_batch=8)
    assert [p.layout for p in tiny_plans.predictions] == [p.layout for p in predictions]
    assert tiny_plans.plans == [p.as_json() for p in predictions]
    assert tiny_plans.best == tiny_plans.plans[0] and tiny_plans.best["fits"]
    assert callable(picofx.planner.predict.predict) and callable(picofx.planner.predict.fake_mode)  # the module is still there


def test_a_model_its_config_and_its_zoo_name_plan_alike(tiny_plans):
    model = Llama(CONFIGS["tiny"])
    assert picofx.plan(model, world=4, seq=32, global_batch=8, gpu="h100").plans == tiny_plans.plans


def test_limits_keep_only_the_layouts_asked_for():
    plans = picofx.plan("llama-tiny", world=4, seq=32, global_batch=8, gpu="h100", tp=2,
                        microbatches=lambda m: m <= 2, checkpoint=False)
    assert plans.predictions and all(p.layout.tp == 2 and p.layout.microbatches <= 2 and not p.layout.checkpoint
                                     for p in plans.predictions)
    with pytest.raises(TypeError, match="unknown limits"):
        picofx.plan("llama-tiny", world=4, seq=32, global_batch=8, gpu="h100", stages=2)


def test_picofx_train_runs_what_picofx_runs_without_accumulation_or_checkpointing():
    assert unrunnable(Layout(4, 1, 1)) is None and unrunnable(Layout(2, 2, 2, shard=True, microbatches=2)) is None
    assert "micro-batches" in unrunnable(Layout(4, 1, 1, microbatches=2))
    assert "checkpointing" in unrunnable(Layout(4, 1, 1, checkpoint=True))
    assert unrunnable(Layout(2, 2, 2, microbatches=2)) is None  # replicated dp over tensor-parallel stages
    assert unrunnable(Layout(4, 1, 1, compress="bf16")) is None and unrunnable(Layout(2, 2, 1, compress="bf16")) is None
    assert "not checked yet" in unrunnable(Layout(2, 2, 1, shard=True, compress="bf16"))


def test_on_one_cpu_process_the_plan_is_calibrated_and_its_passes_train_as_eager():
    torch.manual_seed(0)
    model = Llama(CONFIGS["tiny"])
    said = []
    plans = picofx.plan(model, world=1, seq=32, global_batch=2, gpu="cpu", link=GLOO, say=said.append)
    assert said and said[0].startswith("calibrated:") and "calibrated" in plans.run.device.name
    assert plans.mesh_shape() == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    ids = torch.randint(0, 256, (2, 33))
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    opt = picofx.optimize(model, batch, plans.passes(), backend="eager", loss_fn=causal_lm_loss)
    loss = opt.forward_backward(**batch)
    reference = Llama(CONFIGS["tiny"])
    reference.load_state_dict(model.state_dict())
    expected = causal_lm_loss(reference(batch["input_ids"]), batch["labels"])
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def optimize_each_plan(rank: int, world: int, plans, indices: list) -> list:
    """On one rank: picofx.optimize takes each plan's passes and mesh; one step's loss per plan."""
    from picofx.parallel import ParallelMesh

    losses = []
    for index in indices:
        torch.manual_seed(0)
        model = Llama(CONFIGS["tiny"])
        layout = plans.predictions[index].layout
        ids = torch.randint(0, 256, (8 // layout.dp // (1 if layout.pp > 1 else layout.microbatches), 33),
                            generator=torch.Generator().manual_seed(rank))
        batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
        opt = picofx.optimize(model, batch, plans.passes(index), backend="eager", loss_fn=causal_lm_loss,
                              mesh=ParallelMesh.build(**plans.mesh_shape(index)))
        losses.append(opt.forward_backward(**batch).item())
    return losses


@pytest.mark.slow
def test_the_passes_of_each_plan_kind_run_on_4_gloo_ranks(tiny_plans):
    kinds = {}
    for i, p in enumerate(tiny_plans.predictions):
        layout = p.layout
        if layout.checkpoint or (layout.pp == 1 and layout.microbatches > 1) or not p.fits:
            continue
        kinds.setdefault((layout.dp > 1 and not layout.shard, layout.shard, layout.tp > 1, layout.pp > 1), i)
    assert len(kinds) >= 5, kinds  # replicated, sharded, tp, pp and their compositions
    results = run_ranks(optimize_each_plan, 4, tiny_plans, list(kinds.values()), timeout=600, collective_timeout=240)
    for losses in results:
        assert all(5.0 < loss < 6.0 for loss in losses), losses  # ln 256 = 5.55 from random weights
