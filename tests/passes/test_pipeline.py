"""Pass `pipeline`: cut placement (single process) and pipelined training on 2 and 4 gloo ranks.

Each distributed check runs this file as a script, one process per rank, under a hard deadline;
the test kills the processes it started if they outlive it. Each rank writes what it saw to a
JSON file that the test then asserts on.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import random
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import picofx
from picofx.parallel.layouts import recorded
from picofx.capture.export import capture
from picofx.cost.balance import Unit, balanced_cuts, plan_for
from picofx.cost.device import Link
from picofx.cost.model import CostModel
from picofx.models.zoo import build, hf_llama
from picofx.manager import Context
from picofx.passes import Pipeline
from spawn_ranks import free_port  # tests/passes is on the path, under pytest and as a script

SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)]


# ---------------------------------------------------------------- the cut DP, single process

def _units(times, params=None):
    return [Unit(f"u{i}", t, (params or [0] * len(times))[i], 1, 1) for i, t in enumerate(times)]


def _plan(units, stages, capacity=None):
    return balanced_cuts(units, stages, schedule="1F1B", microbatches=stages, link=Link("instant", 1e30, 0.0),
                         state_per_parameter_byte=1.0, capacity=capacity)


def test_balanced_cuts_put_a_heavy_tail_alone():
    plan = _plan(_units([1, 1, 1, 1, 1, 1, 6]), 2)
    assert plan.cuts == [6]
    assert [s.compute for s in plan.stages] == [6, 6]


def test_balanced_cuts_equal_brute_force_min_max():
    rng = random.Random(0)
    for _ in range(30):
        times = [rng.randint(1, 20) for _ in range(rng.randint(4, 9))]
        stages = rng.randint(2, min(4, len(times)))
        best = min(max(sum(times[a:b]) for a, b in zip((0,) + cuts, cuts + (len(times),)))
                   for cuts in itertools.combinations(range(1, len(times)), stages - 1))
        assert max(s.compute for s in _plan(_units(times), stages).stages) == best


def test_interleaved_cuts_balance_each_ranks_stages_together():
    # Max-stage balance alone gives [2, 4, 6]: rank 0 runs 2 + 2, rank 1 runs 2 + 6 per micro-batch.
    units = _units([1, 1, 1, 1, 1, 1, 6])
    args = dict(schedule="Interleaved1F1B", virtual=2, microbatches=4, link=Link("instant", 1e30, 0.0),
                state_per_parameter_byte=1.0)
    plan = balanced_cuts(units, 4, **args)
    best = min(plan_for(units, [0, *cuts], **args).step_time for cuts in itertools.combinations(range(1, 7), 3))
    assert plan.step_time == pytest.approx(best)
    assert plan.step_time < plan_for(units, [0, 2, 4, 6], **args).step_time


def test_balanced_cuts_keep_each_stage_within_memory():
    # Fastest split is [0,1 | 2,3]; stage 0 would then hold 2 x 100 bytes of parameters, over 150.
    units = _units([1, 1, 1, 1], params=[100, 100, 0, 0])
    assert _plan(units, 2).cuts == [2]
    plan = _plan(units, 2, capacity=150 + 2 * 2)  # + 2 micro-batches in flight x 2 units x 1 byte
    assert plan.cuts == [1] and all(s.memory <= 154 for s in plan.stages)
    with pytest.raises(MemoryError, match="no 2-stage split fits"):
        _plan(units, 2, capacity=50)


def test_schedule_cost_is_the_textbook_bubble_for_equal_stages():
    # 4 stages of equal time, 8 micro-batches: on 4 ranks (p=4, v=1) or on 2 ranks (p=2, v=2)
    for schedule, virtual, ranks in [("GPipe", 1, 4), ("1F1B", 1, 4), ("Interleaved1F1B", 2, 2)]:
        plan = plan_for(_units([1.0] * 4), [0, 1, 2, 3], schedule=schedule, microbatches=8, virtual=virtual,
                        link=Link("instant", 1e30, 0.0), state_per_parameter_byte=1.0)
        assert plan.bubble == pytest.approx((ranks - 1) / (virtual * 8 + ranks - 1))


def _split(balance, stages=2, layers=4, virtual=1, schedule="1F1B"):
    zoo = build("llama-tiny", batch=4, seq=16, num_hidden_layers=layers)
    gm = capture(zoo.model, zoo.example_inputs, zoo.loss_fn)
    signature = gm.meta["picofx_signature"]
    inputs = [zoo.model.get_parameter(s.target) if s.kind == "parameter" else None for s in signature.inputs]
    ctx = Context(model=zoo.model, example_inputs=inputs, device=torch.device("cpu"), cost_model=CostModel())
    microbatches = max(4, stages * virtual)
    return Pipeline(stages=stages, schedule=schedule, microbatches=microbatches, balance=balance, virtual=virtual)(gm, ctx)


def _stage_parameters(gm):
    return sorted(s.target for s in recorded(gm).stage.inputs if not isinstance(s, str) and s.kind == "parameter")


def test_layers_balance_gives_each_stage_equal_layers_and_every_parameter_once():
    result = _split("layers")
    first, last = (_stage_parameters(g) for g in result.graphs)
    assert "embedding.weight" in first and not any(p.startswith(("decoder_layers.2", "decoder_layers.3")) for p in first)
    assert "final_proj.weight" in last and not any(p.startswith(("decoder_layers.0", "decoder_layers.1")) for p in last)
    assert sorted(first + last) == sorted(n for n, _ in build("llama-tiny", num_hidden_layers=4).model.named_parameters())
    assert recorded(result.graphs[-1]).stage.outputs and len(recorded(result.graphs[0]).stage.outputs) == 2


def test_module_paths_choose_where_stages_begin():
    result = _split(["decoder_layers.1", "decoder_layers.3"], stages=3, schedule="GPipe")
    firsts = [min(p for p in _stage_parameters(g) if p.startswith("decoder_layers")) for g in result.graphs[1:]]
    assert [f.split(".")[1] for f in firsts] == ["1", "3"]


def test_cost_balance_is_no_slower_than_layers_and_says_why():
    layers, cost = _split("layers", layers=3), _split("cost", layers=3)
    layer_plan = recorded(layers.graphs[0]).pipeline.plan
    cost_layout = recorded(cost.graphs[0]).pipeline
    assert max(s.time for s in cost_layout.plan.stages) <= max(s.time for s in layer_plan.stages)
    table = cost_layout.table()
    assert "bubble" in table and "cut 1: before" in table and "slowest stage" in table


def test_a_later_stage_receives_its_residual_stream_as_sequence_shards_under_sequence_parallelism():
    from picofx.parallel.stage_inputs import received_sequence_shards

    first, later = _split("layers").graphs
    assert received_sequence_shards(first, 1, 2) == []  # the first stage looks its tokens up itself
    whole = [n for n in later.graph.nodes if n.op == "placeholder" and n.meta["val"].is_floating_point()
             and n.meta["val"].dim() == 3]
    assert [tuple(n.meta["val"].shape) for n in whole] == [(4, 16, 64)]  # the captured batch, 16 tokens
    assert [tuple(n.meta["val"].shape) for n in received_sequence_shards(later, 1, 2)] == [(4, 8, 64)]
    with pytest.raises(ValueError, match=r"\(4, 8, 64\).*3 sequence-parallel ranks do not divide"):
        received_sequence_shards(later, 1, 3)


@pytest.mark.parametrize("options, message", [
    (dict(schedule="Looped"), "unknown schedule 'Looped'"),
    (dict(schedule="ZBVZeroBubble", virtual=2), "ZBVZeroBubble.*compiled picofx stage"),
    (dict(stages=4, microbatches=2), "2 micro-batches are fewer than the 4 pipeline stages"),
    (dict(schedule="Interleaved1F1B", virtual=2, microbatches=5), "rounds of 2"),
    (dict(schedule="1F1B", virtual=2), "virtual=2"),
])
def test_bad_options_are_refused_when_the_pass_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        Pipeline(**{"microbatches": 4, **options})


def test_microbatches_must_divide_the_batch_before_capture():
    zoo = build("llama-tiny", batch=6, seq=8)
    with pytest.raises(ValueError, match="4 micro-batches do not divide the batch of 6"):
        picofx.optimize(zoo.model, zoo.example_inputs, passes=[Pipeline(microbatches=4)], backend="eager",
                        loss_fn=zoo.loss_fn)


def test_more_stages_than_cut_points_is_an_error():
    with pytest.raises(ValueError, match="places to cut"):
        _split("cost", stages=4, layers=1, virtual=8, schedule="Interleaved1F1B")


# ---------------------------------------------------------------- distributed runs

def run_ranks(scenario: str, world: int, tmp_path: Path, deadline: float = 240.0) -> list[dict]:
    """Run `scenario` on `world` ranks (this file as a script); kill them if they pass the deadline."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, scenario, str(rank), str(world), str(port), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    end, logs = time.monotonic() + deadline, []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, end - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{scenario}: ranks still running after {deadline:.0f} s; killed them")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        path = tmp_path / f"{scenario}-{rank}.json"
        assert path.exists(), f"{scenario} rank {rank} wrote no result (exit {p.returncode}):\n{log[-4000:]}"
        results.append(json.loads(path.read_text()))
    return results


def _check_equal_to_reference(results: list[dict], cases: list[str], model) -> None:
    names = {n for n, p in model.named_parameters()}
    for case in cases:
        held = [set(r[case]["parameters"]) for r in results]
        assert set.union(*held) == names and sum(len(h) for h in held) == len(names), case  # each on one rank
        for r in results:
            assert r[case]["loss_error"] is None, f"{case}: {r[case]['loss_error']}"
            assert r[case]["grad_errors"] == [], f"{case}: {r[case]['grad_errors'][:3]}"
            assert r[case]["state_dict_keys"] == sorted(r[case]["parameters"]), case


def test_pipelined_losses_and_gradients_equal_the_full_batch(tmp_path):
    results = run_ranks("equal", 2, tmp_path)
    cases = [f"llama/{s}" for s, _ in SCHEDULES] + ["llama/1F1B measured"]
    _check_equal_to_reference(results, cases, build("llama-tiny").model)
    _check_equal_to_reference(results, [f"hf/{s}" for s, _ in SCHEDULES], hf_llama().model)
    for r in results:
        assert "use opt.forward_backward" in r["call_error"]
    # A checkpoint saved by both ranks with torch.distributed.checkpoint loads into the plain model.
    import torch.distributed.checkpoint as dcp
    trained = _reference_after_sgd()
    plain = build("llama-tiny", batch=4, seq=16, seed=1).model
    state = plain.state_dict()
    with warnings.catch_warnings():  # torch warns that it loads in one process, which is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(tmp_path / "checkpoint"), no_dist=True)
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_errors_reach_every_rank_before_or_instead_of_a_hang_and_tied_weights_sum_their_gradients(tmp_path):
    start = time.monotonic()
    results = run_ranks("errors", 2, tmp_path)
    for rank, r in enumerate(results):
        assert "world of 2 ranks does not divide into groups of 3 (pp 3)" in r["world"]
        tied = r["tied"]  # the embedding and head are one parameter, read by both stages
        assert tied["loss_error"] is None and tied["grad_errors"] == [], tied
        assert "model.embed_tokens.weight" in tied["parameters"]
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(tied["state_dict_keys"])
    assert "do not divide the batch" in results[1]["failing_rank"]
    assert "timed out" in results[0]["failing_rank"].lower() or "connection" in results[0]["failing_rank"].lower()
    assert time.monotonic() - start < 200


def test_two_stages_times_two_replicas_average_each_stage_over_its_replicas(tmp_path):
    results = run_ranks("dp_pp", 4, tmp_path)
    assert set(results[0]) == {"1F1B", "1F1B+overlap"}
    for case in results[0]:
        for rank, r in enumerate(results):
            assert r[case]["loss_error"] is None, f"{case} rank {rank}: {r[case]['loss_error']}"
            assert r[case]["grad_errors"] == [], f"{case} rank {rank}: {r[case]['grad_errors'][:3]}"
        # ranks (0, 1) and (2, 3) are the pipelines; 0 and 2 hold the same stage
        assert results[0][case]["parameters"] == results[2][case]["parameters"]
        assert set(results[0][case]["parameters"]).isdisjoint(results[1][case]["parameters"])


@pytest.mark.slow
def test_inductor_stages_equal_the_full_batch(tmp_path):
    results = run_ranks("inductor", 2, tmp_path, deadline=500)
    _check_equal_to_reference(results, ["llama/1F1B"], build("llama-tiny").model)


# ---------------------------------------------------------------- what each rank runs

def _reference_grads(zoo):
    model, batch = zoo.model, zoo.example_inputs
    out = model(batch["input_ids"]) if zoo.loss_fn else model(**batch)
    loss = zoo.loss_fn(out, batch["labels"]) if zoo.loss_fn else out.loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _reference_after_sgd():
    zoo = build("llama-tiny", batch=4, seq=16, seed=0)
    _reference_grads(zoo)
    with torch.no_grad():
        for p in zoo.model.parameters():
            p -= 0.1 * p.grad
    return zoo.model


def _run_case(make, schedule, virtual, backend="eager", group=None, replica=None, extra=(), **options):
    """Pipelined step against the single-process full batch; with `replica` = (index, count) this
    rank's pipeline trains that share of the batch and its loss is compared with that share's."""
    zoo, reference = make(), make()
    batch = zoo.example_inputs
    if replica is not None:
        index, count = replica
        batch = {k: v.chunk(count)[index] for k, v in batch.items()}
    opt = picofx.optimize(zoo.model, batch, backend=backend, loss_fn=zoo.loss_fn, passes=[
        *extra, Pipeline(stages=2, schedule=schedule, microbatches=4, virtual=virtual, group=group, **options)])
    loss = opt.forward_backward(**batch)
    ref_loss, ref_grads = _reference_grads(reference)
    if replica is not None:
        ref_loss, _ = _reference_grads(dataclasses.replace(make(), example_inputs=batch))
    result = {"loss_error": None, "grad_errors": [], "parameters": sorted(n for n, _ in opt.named_parameters()),
              "state_dict_keys": sorted(opt.state_dict())}
    try:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    except AssertionError as e:
        result["loss_error"] = str(e)
    for name, p in opt.named_parameters():
        try:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6)
        except (AssertionError, TypeError) as e:
            result["grad_errors"].append(f"{name}: {e}")
    return opt, result


def _error_text(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the text is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def scenario_equal(rank: int, out: Path) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    results = {}
    llama = lambda: build("llama-tiny", batch=4, seq=16)  # noqa: E731
    hf = lambda: hf_llama(batch=4, seq=16)  # noqa: E731
    for prefix, make in (("llama", llama), ("hf", hf)):
        for schedule, virtual in SCHEDULES:
            opt, results[f"{prefix}/{schedule}"] = _run_case(make, schedule, virtual)
            if prefix == "llama" and schedule == "1F1B":
                batch = make().example_inputs
                results["call_error"] = _error_text(lambda: opt(**batch))
                with torch.no_grad():
                    for p in opt.parameters():
                        p -= 0.1 * p.grad
                dcp.save(opt.state_dict(), checkpoint_id=str(out / "checkpoint"))
                dist.barrier()
    # cut by unit times measured on rank 0 and sent to rank 1: both cut alike, or the runtime raises
    _, results["llama/1F1B measured"] = _run_case(llama, "1F1B", 1, measure=True)
    return results


def scenario_errors(rank: int, out: Path) -> dict:
    zoo = build("llama-tiny", batch=4, seq=16)
    results = {"world": _error_text(lambda: picofx.optimize(
        zoo.model, zoo.example_inputs, passes=[Pipeline(stages=3, microbatches=4)], backend="eager",
        loss_fn=zoo.loss_fn))}
    _, results["tied"] = _run_case(lambda: hf_llama(batch=4, seq=16, tie_word_embeddings=True), "1F1B", 1)
    opt = picofx.optimize(zoo.model, zoo.example_inputs, passes=[Pipeline(microbatches=4)], backend="eager",
                          loss_fn=zoo.loss_fn)
    batch = dict(zoo.example_inputs)
    if rank == 1:  # this rank fails before sending anything; rank 0 must not wait forever
        batch = {k: torch.cat([v, v[:2]]) for k, v in batch.items()}
    results["failing_rank"] = _error_text(lambda: opt.forward_backward(**batch))
    return results


def scenario_dp_pp(rank: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = (mesh.get_local_rank("dp"), 2)
    make = lambda: build("llama-tiny", batch=8, seq=16)  # noqa: E731
    results = {}
    _, results["1F1B"] = _run_case(make, "1F1B", 1, group=mesh, replica=replica)
    # overlap averages each stage's parameter gradients over its replicas inside the backward
    _, results["1F1B+overlap"] = _run_case(make, "1F1B", 1, group=mesh, replica=replica, extra=["overlap"])
    return results


def scenario_inductor(rank: int, out: Path) -> dict:
    _, result = _run_case(lambda: build("llama-tiny", batch=4, seq=16), "1F1B", 1, backend="inductor")
    return {"llama/1F1B": result}


def main(scenario: str, rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    timeout = 15 if scenario == "errors" else 120
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    results = globals()[f"scenario_{scenario}"](rank, Path(out))
    Path(out, f"{scenario}-{rank}.json").write_text(json.dumps(results))
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
