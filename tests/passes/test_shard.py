"""shard: two gloo ranks (spawned, hard timeout) against the single-process full batch.

One spawn per scenario file runs several checks (a capture and compile costs seconds per rank);
comparisons happen here. Tolerances (DESIGN §9): loss rtol 1e-5, gradients rtol 1e-4, parameters
after AdamW atol 1e-5 at lr 1e-3."""
from __future__ import annotations

import re
import time

import pytest
import torch

import picofx
from picofx.models import real_models, zoo
from picofx.passes import Shard

import shard_ranks
from overlap_ranks import later_batch
from spawn_ranks import run_ranks, run_scenarios

LOSS = dict(rtol=1e-5, atol=1e-7)
GRAD = dict(rtol=1e-4, atol=1e-6)
BATCH = 4  # two ranks of 2
GATHER = "_c10d_functional.all_gather_into_tensor.default"
SCATTER = "_c10d_functional.reduce_scatter_tensor.default"


def full_batch(z: zoo.ZooModel, batch: dict) -> torch.Tensor:
    out = z.model(**batch) if z.loss_fn is None else z.loss_fn(z.model(batch["input_ids"]), batch["labels"])
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return loss.detach()


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads(actual: dict, expected: dict, **tol):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def assert_mean_loss(ranks: list, expected: torch.Tensor, key: str = "loss"):
    torch.testing.assert_close(torch.stack([r[key] for r in ranks]).mean(), expected, **LOSS)


def reference_adamw(steps: int = 3) -> tuple[dict, torch.Tensor]:
    """The single-process loop the ranks run: full batches, clip to norm 1, AdamW at lr 1e-3."""
    z = zoo.build("llama-tiny", batch=BATCH)
    optimizer = torch.optim.AdamW(z.model.parameters(), lr=1e-3)
    norms = []
    for step in range(steps):
        z.model.zero_grad(set_to_none=True)
        full_batch(z, later_batch(z.example_inputs, step + 5))
        norms.append(torch.nn.utils.clip_grad_norm_(z.model.parameters(), max_norm=1.0))
        optimizer.step()
    return {n: p.detach() for n, p in z.model.named_parameters()}, torch.stack(norms)


VOCAB = 257  # odd: the embedding and head split 129 + 128 rows, padded to 129 in the graph


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank scenarios in one spawned group (a group each cost a start, imports and fuse's
    patterns); the one that raises on purpose gets a group of its own."""
    directory = str(tmp_path_factory.mktemp("shard_checkpoint"))
    calls = [(shard_ranks.reference_llama_checks, BATCH, directory), (shard_ranks.hf_llama_checks, BATCH, VOCAB),
             (shard_ranks.mixed_precision_checks, BATCH)]
    return run_scenarios(calls, 2, timeout=1000, collective_timeout=60)


@pytest.fixture(scope="module")
def llama_ranks(two_ranks):
    return two_ranks["reference_llama_checks"]


@pytest.fixture(scope="module")
def llama_reference():
    z = zoo.build("llama-tiny", batch=BATCH)
    return full_batch(z, z.example_inputs), grads(z.model)


def test_reference_llama_matches_full_batch(llama_ranks, llama_reference):
    loss, expected = llama_reference
    assert_mean_loss(llama_ranks, loss)
    for r in llama_ranks:
        assert_grads(r["grads"], expected, **GRAD)


def test_accumulation_sums_micro_batches(llama_ranks, llama_reference):
    _, first = llama_reference
    z = zoo.build("llama-tiny", batch=BATCH)
    full_batch(z, later_batch(z.example_inputs, 3))
    for r in llama_ranks:
        assert_grads(r["accumulated"], {n: first[n] + p.grad for n, p in z.model.named_parameters()}, **GRAD)


def test_graphs_gather_a_bucket_per_layer_and_prefetch(llama_ranks):
    r = llama_ranks[0]
    notes = r["notes"]["forward.forward"]
    layers = 2  # llama-tiny: the embedding, two decoder layers, the final norm with the head
    assert notes["buckets"] == layers + 2 and len(notes["gathers"]) == layers + 2
    assert r["forward_ops"][GATHER] == layers + 2 and r["backward_ops"][SCATTER] == layers + 2
    assert r["notes"]["partitioned.backward"]["averaged_gradients"] == len(r["names"])
    # prefetch=1: each gather is issued before the previous bucket's wait
    order = r["forward_order"]
    assert order[:3] == ["gather", "gather", "wait"] and order.count("gather") == layers + 2
    # reshard_after_forward: nothing gathered is saved; the backward gathers again (not the embedding)
    assert r["saved_gathers"] == 0 and r["backward_ops"][GATHER] == layers + 1


def test_collectives_are_functional_and_reduce_scatters_wait_behind_the_next_buckets_matmuls(llama_ranks):
    """The graphs the step runs (eager: as they are) show each collective as a functional one, the
    backward's reduce-scatters waited after matmuls issued behind them, without the cost model's
    predicted backward peak rising, and this rank's measured peak within its predicted peak."""
    for r in llama_ranks:
        assert r["namespaces"] == ["_c10d_functional"]
        assert len(r["scatters_overlapped"]) == 4 and max(r["scatters_overlapped"]) > 0, r["scatters_overlapped"]
        schedule = r["notes"]["partitioned.backward"]["schedule"]
        assert schedule["waited_after_next_bucket"] >= 1
        peaks = schedule["predicted_backward_peak"]
        assert peaks["after"] <= peaks["before"], peaks
        memory = r["memory"]
        assert memory["measured_peak"] <= memory["predicted_peak"] * 1.05, memory


def test_parameters_gradients_and_optimizer_state_are_sharded(llama_ranks):
    for r in llama_ranks:
        assert r["dtensor_params"] and r["dtensor_grads"] and r["placements"] == ["(Shard(dim=0),)"]
        assert r["local_bytes"] <= r["full_bytes"] / 2 + r["row_bytes"]  # 1/N + at most a row of padding each
        assert r["local_grad_bytes"] == r["local_bytes"]
        assert r["optimizer_state_bytes"] <= 2 * r["local_bytes"] + 64  # exp_avg, exp_avg_sq (+ steps)
        assert r["opt_names"] == r["names"]  # the model's own names
    assert sum(r["local_bytes"] for r in llama_ranks) == llama_ranks[0]["full_bytes"]


def test_adamw_with_clipping_matches_single_process(llama_ranks):
    params, norms = reference_adamw()
    for r in llama_ranks:
        torch.testing.assert_close(r["norms"], norms, rtol=1e-4, atol=1e-6)
        for name, p in params.items():
            torch.testing.assert_close(r["params"][name], p, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_distributed_checkpoint_loads_into_the_plain_model(llama_ranks):
    loaded = llama_ranks[0]["state_dict"]
    assert set(loaded) == set(llama_ranks[0]["params"])
    for name, value in llama_ranks[0]["params"].items():
        assert torch.equal(loaded[name], value), name


def test_reshard_after_forward_false_keeps_gathered_parameters(llama_ranks, llama_reference):
    loss, expected = llama_reference
    kept = [r["kept"] for r in llama_ranks]
    assert_mean_loss(kept, loss)
    for r in kept:
        assert_grads(r["grads"], expected, **GRAD)
    assert kept[0]["saved_gathers"] > 0 and GATHER not in kept[0]["backward_ops"]
    count = len(llama_ranks[0]["names"])  # bucket=0, prefetch=0: per parameter, issued just before use
    assert kept[0]["forward_order"] == ["gather", "wait"] * count


@pytest.mark.parametrize("case", ["composed", "mixed"])
def test_composes_with_fuse_precision_and_checkpoint(llama_ranks, case):
    """bf16 matmuls: the tolerance of precision (per tensor, normwise), as test_overlap's. "mixed":
    Shard(mixed_precision="bf16") gathers and reduce-scatters in bf16; the master copy stays fp32."""
    composed = [r[case] for r in llama_ranks]
    assert composed[0]["passes"] == ["checkpoint", "fuse", "precision", "shard"]
    wire = ["torch.bfloat16"] if case == "mixed" else ["torch.float32"]
    assert composed[0]["gathered"] == wire and composed[0]["reduced"] == wire
    assert composed[0]["param_dtypes"] == ["torch.float32"]
    z = zoo.build("llama-tiny", batch=BATCH, seq=shard_ranks.COMPOSED_SEQ)
    opt = picofx.optimize(z.model, z.example_inputs, shard_ranks.COMPOSED, backend="eager", loss_fn=z.loss_fn)
    loss = opt.forward_backward(**z.example_inputs)
    torch.testing.assert_close(torch.stack([r["loss"] for r in composed]).mean(), loss, rtol=1e-2, atol=1e-3)
    for r in composed:
        for name, p in z.model.named_parameters():
            assert (r["grads"][name] - p.grad).norm() <= 2e-2 * p.grad.norm() + 1e-6, name


def test_hf_llama_with_uneven_tied_vocabulary_and_recapture_match_full_batch(two_ranks):
    vocab, ranks = VOCAB, two_ranks["hf_llama_checks"]
    z = zoo.build("hf-llama-tiny", batch=BATCH, vocab_size=vocab, tie_word_embeddings=True)
    loss = full_batch(z, z.example_inputs)
    assert_mean_loss(ranks, loss)
    for r in ranks:
        assert_grads(r["grads"], grads(z.model), **GRAD)
        assert r["dtensor_params"] and r["dtensor_grads"]
    assert [r["local_rows"]["model.embed_tokens.weight"] for r in ranks] == [129, 128]
    assert all(r["still_tied"] for r in ranks)
    assert sum(r["local_bytes"] for r in ranks) == ranks[0]["full_bytes"]
    assert all(r["local_bytes"] <= r["full_bytes"] / 2 + r["row_bytes"] for r in ranks)
    z = zoo.build("hf-llama-tiny", batch=BATCH, vocab_size=vocab, tie_word_embeddings=True)
    short_loss = full_batch(z, {k: v[:, :16].contiguous() for k, v in z.example_inputs.items()})
    assert_mean_loss(ranks, short_loss, "recaptured_loss")
    for r in ranks:
        assert_grads(r["recaptured_grads"], grads(z.model), **GRAD)
        assert r["still_sharded"]
    qwen = real_models.hf_model("qwen2", batch=BATCH)
    loss = full_batch(qwen, qwen.example_inputs)
    assert_mean_loss(ranks, loss, "qwen2_loss")
    for r in ranks:
        assert_grads(r["qwen2_grads"], grads(qwen.model), **GRAD)


def test_layout_mismatch_raises_on_every_rank_within_seconds():
    start = time.perf_counter()
    errors = run_ranks(shard_ranks.mismatched_layout, 2, timeout=120, collective_timeout=30, expect_errors=True)
    assert time.perf_counter() - start < 60  # well before the collective timeout would fire
    for error in errors:
        assert error is not None and "parameter shard layout differs" in error, error
        assert "decoder_layers.1.mlp.up_proj.weight" in error and "frozen" in error, error


def test_no_process_group_says_how_to_launch():
    z = zoo.build("llama-tiny", batch=2)
    with pytest.raises(picofx.PassError, match="launch with torchrun"):
        picofx.optimize(z.model, z.example_inputs, [Shard()], backend="eager", loss_fn=z.loss_fn)


def test_options_are_checked():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with pytest.raises(NotImplementedError, match="mixed_precision"):
        Shard(mixed_precision="fp16")
    with pytest.raises(NotImplementedError, match="output_dtype"):
        Shard(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    with pytest.raises(NotImplementedError, match="param_dtype=torch.float16"):
        Shard(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.float16))
    Shard(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    with pytest.raises(ValueError, match="prefetch"):
        Shard(prefetch=-1)
    assert picofx.manager.pass_info(Shard()).mesh_dims == ("dp_shard",)


@pytest.mark.slow
def test_inductor_matches_full_batch_and_keeps_collectives():
    ranks = run_ranks(shard_ranks.inductor_checks, 2, BATCH, timeout=560, collective_timeout=300)
    z = zoo.build("llama-tiny", batch=BATCH)
    loss = full_batch(z, z.example_inputs)
    assert_mean_loss(ranks, loss)
    for r in ranks:
        assert_grads(r["grads"], grads(z.model), **GRAD)
    code = "\n".join(ranks[0]["code"])
    assert re.search(r"all_gather_into_tensor", code) and re.search(r"reduce_scatter_tensor", code)
    assert ranks[0]["namespaces"] == ["_c10d_functional"] and max(ranks[0]["scatters_overlapped"]) > 0


@pytest.mark.slow  # 4 ranks, three optimized models, a DCP round trip: minutes on a shared CPU
def test_hsdp_shards_within_dp_shard_and_replicates_across_dp_replicate_on_four_ranks(tmp_path):
    """dp_replicate 2 x dp_shard 2: gradients reduce-scattered within dp_shard, then all-reduced
    across dp_replicate, as FSDP2's HSDP; parameters (Replicate(), Shard(0)) DTensors on the 2-D mesh."""
    ranks = run_ranks(shard_ranks.hsdp_checks, 4, BATCH, str(tmp_path), timeout=600, collective_timeout=300)
    z = zoo.build("llama-tiny", batch=BATCH)
    loss = full_batch(z, z.example_inputs)
    expected = grads(z.model)
    assert_mean_loss(ranks, loss)
    assert_mean_loss(ranks, loss, "given_loss")
    params, norms = reference_adamw(steps=2)
    for r in ranks:
        assert_grads(r["grads"], expected, **GRAD)
        assert_grads(r["given_grads"], expected, **GRAD)
        assert r["namespaces"] == ["_c10d_functional"]
        assert r["backward_ops"]["_c10d_functional.all_reduce.default"] == r["backward_ops"][SCATTER] == 4
        assert r["dtensor_params"] and r["dtensor_grads"]
        assert r["placements"] == ["(Replicate(), Shard(dim=0))"] and r["mesh_dims"] == [("dp_replicate", "dp_shard")]
        torch.testing.assert_close(r["norms"], norms, rtol=1e-4, atol=1e-6)
        for name, p in params.items():
            torch.testing.assert_close(r["params"][name], p, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        assert "HSDP" in r["compress_refused"] and "compress" in r["compress_refused"]
    assert ranks[0]["local_bytes"] + ranks[1]["local_bytes"] == ranks[0]["full_bytes"]  # a replica: ranks 0, 1
    loaded = ranks[0]["state_dict"]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(loaded[name], value), name


def test_hsdp_refuses_what_it_cannot_run_before_any_rank_waits():
    from picofx.parallel import ParallelMesh
    from picofx.passes.shard.shard import shard_dims

    with_tp = ParallelMesh((("pp", 1), ("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)))
    with pytest.raises(NotImplementedError, match=r"HSDP \(dp_replicate 2 x dp_shard 2\) with tp"):
        shard_dims(Shard(), with_tp)
    hsdp = ParallelMesh((("pp", 1), ("dp_replicate", 2), ("dp_shard", 2), ("tp", 1)))
    with pytest.raises(NotImplementedError, match="compress='int8'.*HSDP"):
        shard_dims(Shard(compress="int8"), hsdp)


def test_shard_times_pipeline_on_four_ranks():
    ranks = run_ranks(shard_ranks.with_pipeline, 4, timeout=600, collective_timeout=300)
    z = zoo.build("llama-tiny", batch=4)
    loss = full_batch(z, z.example_inputs)
    expected = grads(z.model)
    held = set()
    for r in ranks:
        torch.testing.assert_close(r["loss"], loss, **LOSS)
        assert r["sharded"] and r["local_bytes"] <= r["whole_bytes"] // 2 + 4096
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, expected[name], **GRAD, msg=lambda m, n=name: f"{n}: {m}")
        held |= set(r["grads"])
    assert held == set(expected)  # every parameter on some stage


def test_mixed_precision_policy_reduces_in_fp32_as_fsdp2_and_reports_memory_per_rank(two_ranks):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): gathers in bf16, reduce-scatters
    the gradients cast up to fp32, fp32 master shards. Gradients against FSDP2 with the same policy:
    both compute in bf16 but round differently (FSDP2 runs every op in bf16, precision keeps norms
    and softmax in fp32), so per tensor normwise within 2e-2, the precision pass's own tolerance."""
    ranks = two_ranks["mixed_precision_checks"]
    for r in ranks:
        assert r["gathered"] == ["torch.bfloat16"] and r["reduced"] == ["torch.float32"]
        assert r["param_dtypes"] == ["torch.float32"]
        assert r["grads"].keys() == r["fsdp_grads"].keys()
        for name, expected in r["fsdp_grads"].items():
            assert (r["grads"][name] - expected).norm() <= 2e-2 * expected.norm() + 1e-6, name
        notes = r["notes"]
        assert notes["forward.forward"]["reduce_dtype"] == "torch.float32"
        reductions = notes["partitioned.backward"]["reductions"]
        assert [x["dtype"] for x in reductions] == ["torch.float32"] * 4
        buckets = notes["forward.forward"]["gathers"]
        assert all(b["reduced_bytes"] == 2 * b["gathered_bytes"] for b in buckets)  # fp32 gradients, bf16 weights
        assert sorted(x["reduced_bytes"] for x in reductions) == sorted(b["reduced_bytes"] for b in buckets)
        memory = r["memory"]
        assert 0.8 <= memory["measured_peak"] / memory["predicted_peak"] <= 1.25, memory
        assert f"rank {r['memory']['rank']}: predicted peak" in r["report"] and "shard: reductions" in r["report"]
    z = zoo.build("llama-tiny", batch=BATCH)
    torch.testing.assert_close(torch.stack([r["loss"] for r in ranks]).mean(),
                               full_batch(z, z.example_inputs), rtol=1e-2, atol=1e-3)
