"""Shard's stages 1 and 2 on gloo ranks against one process on the full batch.

Each step is 4 micro-batches (4 calls: the first step's under no_sync, the second's by
set_requires_gradient_sync; or a pipeline's 4), then the gradient norm clipped to 1 and an AdamW
step at lr 1e-3; two steps. Loss rtol 1e-5, gradients rtol 1e-4, parameters after AdamW atol 5e-5:
the micro-batches sum each gradient in another order, and AdamW divides a near-zero gradient by its
own root mean square, so an element whose gradient is ~0 moves by a few percent of lr (1e-3)
differently (DESIGN §9). At 8 tokens per sequence (more gradients near 0) that moved parameters by
more than 5e-5 and the second step's gradients past rtol 1e-4; at 16 both hold. The collectives
are counted per step: stage 1 reduce-scatters every gradient once per step, stage 2 once per
micro-batch; both gather every parameter once per step (after the optimizer changed the shards),
not per micro-batch.
One spawned group per world: 2 ranks (stage 1's accumulation with a zero_grad mid-step, stage 2's
reduce-scatters traced behind the next micro-batch, and completed by the optimizer's step after
unsynced backwards, in CI),
4 (slow: stage 2's accumulation over dp_shard 4; both stages on pp 2 x dp_shard 2, beside tp on
dp_shard 2 x tp 2, and HSDP on dp_replicate 2 x dp_shard 2) and 8 (slow: both stages on pp 2 x
dp_shard 2 x tp 2, stage 2 with sequence parallelism)."""
from __future__ import annotations

import math

import pytest
import torch

import picofx
from picofx.models import zoo
from picofx.passes import Shard

import shard_stages_ranks as ranks
from spawn_ranks import run_scenarios

GROUPS: dict = {}


def group(world: int, tmp_path_factory) -> dict:
    if world not in GROUPS:
        calls = {2: [(ranks.stage1_accumulation, str(tmp_path_factory.mktemp("dcp"))), (ranks.stage2_in_flight,)],
                 4: [(ranks.stage2_accumulation,), (ranks.stage1_pipeline,), (ranks.stage2_pipeline,),
                     (ranks.stage1_tensor_parallel, str(tmp_path_factory.mktemp("dcp"))),
                     (ranks.stage2_sequence_parallel, str(tmp_path_factory.mktemp("dcp"))),
                     (ranks.stage1_hsdp,), (ranks.stage2_hsdp,)],
                 8: [(ranks.stage1_tensor_parallel_pipeline,), (ranks.stage2_sequence_parallel_pipeline,)]}[world]
        GROUPS[world] = run_scenarios(calls, world, timeout=600 if world < 8 else 900, collective_timeout=120)
    return GROUPS[world]


def reference(steps: int = 2) -> dict:
    """The same loop in one process: the full batch each step, clipped, AdamW."""
    z = zoo.build("llama-tiny", batch=ranks.BATCH, seq=ranks.SEQ)
    optimizer = torch.optim.AdamW(z.model.parameters(), lr=1e-3)
    out = {"losses": [], "grads": []}
    for step in range(steps):
        batch = ranks.batch_of(step, 0, 1)
        loss = z.loss_fn(z.model(batch["input_ids"]), batch["labels"])
        loss.backward()
        out["losses"].append(loss.detach())
        out["grads"].append({n: p.grad.detach().clone() for n, p in z.model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(z.model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out["params"] = {n: p.detach().clone() for n, p in z.model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def expected() -> dict:
    return reference()


SHARDED = ("(Shard(dim=0),)",)  # AdamW's moments: shards over dp_shard
BESIDE_TP = ("(Shard(dim=0), ", "(_StridedShard(dim=0")  # shards over dp_shard of tp's pieces (2-D)
HSDP = ("(Replicate(), Shard(dim=0))",)  # shards over dp_shard, replicated over dp_replicate


def assert_trains_like_one_process(results: list, expected: dict, state: tuple = SHARDED) -> None:
    """Loss and gradients each step, the parameters after, and the optimizer state's placements (each
    starts with one of `state`)."""
    for step, want in enumerate(expected["losses"]):
        by_replica = {r["replica"]: r["losses"][step] for r in results}
        torch.testing.assert_close(torch.stack(list(by_replica.values())).mean(), want, rtol=1e-5, atol=1e-7)
        held = set()
        for r in results:
            for name, g in r["grads"][step].items():
                torch.testing.assert_close(g, expected["grads"][step][name], rtol=1e-4, atol=1e-6, msg=name)
            held |= set(r["grads"][step])
        assert held == set(expected["grads"][step])
    for r in results:
        assert r["state"] and all(s.startswith(state) for s in r["state"]), r["state"]
        for name, value in r["params"].items():
            torch.testing.assert_close(value, expected["params"][name], rtol=0, atol=5e-5, msg=name)


def shard_elements(shapes: dict, ranks_: int) -> int:
    """Elements of every held parameter's padded shard (ceil(rows / ranks) rows each)."""
    return sum(math.ceil(s[0] / ranks_) * math.prod(s[1:]) for s in shapes.values())


def assert_collectives(result: dict, stage: int, dp: int, tp: int = 1) -> None:
    """Per step: one gather of every parameter's shard (the first step's ran at optimize), and every
    gradient reduce-scattered once (stage 1) or once per micro-batch (stage 2). Beside tp, a shard
    is of this rank's tp piece (every piece divides by dp here)."""
    shard = shard_elements(result["shapes"], dp) if tp == 1 else result["local_elements"]
    scatters = 1 if stage == 1 else ranks.MICRO
    for step, calls in enumerate(result["collectives"]):
        assert calls.count(("all_gather_single", shard)) == (step > 0), calls
        assert calls.count(("reduce_scatter_single", dp * shard)) == scatters, calls
        assert len(calls) == (step > 0) + scatters, calls


@pytest.mark.parametrize("scenario,stage,world", [
    ("stage1_accumulation", 1, 2), pytest.param("stage2_accumulation", 2, 4, marks=pytest.mark.slow)])
def test_stage_accumulates_like_one_process(scenario, stage, world, expected, tmp_path_factory):
    """4 micro-batches a step, accumulated by no_sync, then by set_requires_gradient_sync. Stage 1's
    steps first accumulate a micro-batch of other tokens and zero the gradients (optimizer.zero_grad,
    to None, then in place), as a loop that skips a step does: its whole gradients live outside the
    DTensor `.grad` that zero_grad clears, yet none of them may reach the step (as with FSDP2)."""
    results = group(world, tmp_path_factory)[scenario]
    assert_trains_like_one_process(results, expected)
    for r in results:
        assert_collectives(r, stage, dp=world)
        assert r["notes"][0]["stage"] == stage


def test_stage2_reduce_scatter_runs_behind_the_next_micro_batch(expected, tmp_path_factory):
    """dp_shard 2, 4 micro-batches after a discarded one (zero_grad between): each backward's
    reduce-scatter is issued asynchronously and still in flight when the next forward starts, waited
    at the end of the next backward before that one's is issued, and the synced backward returns only
    after its own completed. The discarded micro-batch's completes after the zero_grad: dropped."""
    results = group(2, tmp_path_factory)["stage2_in_flight"]
    assert_trains_like_one_process(results, expected)
    want = [("issue", 0)]  # the discarded micro-batch's
    for i in range(ranks.MICRO):
        want += [("forward", i), ("wait", i), ("issue", i + 1)]
        want += [("wait", i + 1)] if i == ranks.MICRO - 1 else []
        want += [("returned", i)]
    for r in results:
        for events in r["events"]:
            assert events == want, events


def test_stage2_optimizer_step_completes_the_reduce_scatter_left_in_flight(expected, tmp_path_factory):
    """dp_shard 2, a step whose 4 backwards all ran under no_sync: the last reduce-scatter is still in
    flight when the backward returns; the optimizer's step waits for it first, and steps on the
    gradients of all 4 micro-batches (equal to one process's on the full batch)."""
    for r in group(2, tmp_path_factory)["stage2_in_flight"]:
        unsynced = r["unsynced"]
        last = ranks.MICRO - 1
        assert unsynced["before_step"][-1] == ("issue", last) and ("wait", last) not in unsynced["before_step"]
        assert unsynced["after_step"] == [("wait", last)], unsynced["after_step"]
        for name, g in unsynced["grads"].items():
            torch.testing.assert_close(g, expected["grads"][0][name], rtol=1e-4, atol=1e-6, msg=name)
        assert set(unsynced["grads"]) == set(expected["grads"][0])


def test_stage1_checkpoint_round_trips_with_dcp(tmp_path_factory):
    assert all(r["restored"] for r in group(2, tmp_path_factory)["stage1_accumulation"])


@pytest.mark.slow
@pytest.mark.parametrize("scenario,stage", [("stage1_pipeline", 1), ("stage2_pipeline", 2)])
def test_stage_beside_a_pipeline_trains_like_one_process(scenario, stage, expected, tmp_path_factory):
    """pp 2 x dp_shard 2: each pipeline rank's parameters gathered once a step, not per micro-batch."""
    results = group(4, tmp_path_factory)[scenario]
    assert_trains_like_one_process(results, expected)
    for r in results:
        assert_collectives(r, stage, dp=2)


@pytest.mark.slow
@pytest.mark.parametrize("scenario,stage", [("stage1_tensor_parallel", 1), ("stage2_sequence_parallel", 2)])
def test_stage_beside_tensor_parallelism_trains_like_one_process(scenario, stage, expected, tmp_path_factory):
    """dp_shard 2 x tp 2 (stage 2 with sequence parallelism): parameters 2-D DTensors as FSDP2 over TP
    places them, the graph reading each tp piece whole; clipped AdamW steps (stage 1's with a zero_grad
    mid-step), DCP round trip."""
    results = group(4, tmp_path_factory)[scenario]
    assert_trains_like_one_process(results, expected, BESIDE_TP)
    for r in results:
        assert_collectives(r, stage, dp=2, tp=2)
        assert r["restored"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario,stage", [("stage1_tensor_parallel_pipeline", 1),
                                            ("stage2_sequence_parallel_pipeline", 2)])
def test_stage_beside_tensor_parallelism_and_a_pipeline_trains_like_one_process(scenario, stage, expected,
                                                                                tmp_path_factory):
    """pp 2 x dp_shard 2 x tp 2 (stage 2 with sequence parallelism), 4 micro-batches a schedule: each
    pipeline rank's tp pieces gathered once a step, reduce-scattered once a step (stage 1) or once per
    micro-batch (stage 2), over dp_shard only."""
    results = group(8, tmp_path_factory)[scenario]
    assert_trains_like_one_process(results, expected, BESIDE_TP)
    for r in results:
        assert_collectives(r, stage, dp=2, tp=2)


@pytest.mark.slow
@pytest.mark.parametrize("scenario,stage", [("stage1_hsdp", 1), ("stage2_hsdp", 2)])
def test_stage_with_hsdp_trains_like_one_process(scenario, stage, expected, tmp_path_factory):
    """dp_replicate 2 x dp_shard 2: the shards replicated, each reduce-scatter's shard all-reduced
    across the replicas (stage 1's steps with a zero_grad mid-step)."""
    results = group(4, tmp_path_factory)[scenario]
    assert_trains_like_one_process(results, expected, HSDP)
    for r in results:
        assert_collectives(r, stage, dp=2)
        assert r["notes"][0]["replicas"] == 2


def test_stage_is_checked_and_refuses_what_it_does_not_build():
    with pytest.raises(ValueError, match=r"Shard\(stage=4\): give 1"):
        Shard(stage=4)
    with pytest.raises(NotImplementedError, match="stages 1 and 2 reduce-scatter whole fp32 gradients"):
        Shard(stage=1, compress="int8")
    with pytest.raises(NotImplementedError, match="drop mixed_precision"):
        Shard(stage=2, mixed_precision="bf16")


@pytest.mark.slow
def test_one_process_stage_trains_like_the_model():
    """A one-rank group: stage 1 runs the graph whole and its gradients equal the plain model's."""
    from picofx.parallel.mesh import one_process_group

    one_process_group()
    z, plain = zoo.build("llama-tiny", batch=2, seq=8), zoo.build("llama-tiny", batch=2, seq=8)
    opt = picofx.optimize(z.model, z.example_inputs, [Shard(stage=1)], backend="eager", loss_fn=z.loss_fn)
    loss = opt.forward_backward(**z.example_inputs)
    want = plain.loss_fn(plain.model(plain.example_inputs["input_ids"]), plain.example_inputs["labels"])
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-7)
    for name, p in plain.model.named_parameters():
        torch.testing.assert_close(z.model.get_parameter(name).grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-7)
