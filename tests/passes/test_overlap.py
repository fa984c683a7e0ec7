"""overlap: two gloo ranks (spawned, hard timeout) against the single-process full batch.

Each spawned run batches several checks (a capture and compile costs seconds per rank); the
comparisons happen here, in the test process. Tolerances: fp32 loss rtol 1e-5, gradients rtol
1e-4 (the full batch sums its rows in another order than two half batches and an all-reduce).
bf16 compression: see test_bf16_compression."""
from __future__ import annotations

import copy
import re

import pytest
import torch

import picofx
from picofx.cost.comm import Gradient, all_reduce_seconds, fixed_bounds, plan_buckets
from picofx.cost.device import H100, Link
from picofx.models import zoo
from picofx.passes import Overlap

import overlap_ranks
from spawn_ranks import run_ranks, run_scenarios

LOSS = dict(rtol=1e-5, atol=1e-7)
GRAD = dict(rtol=1e-4, atol=1e-6)
BATCH = 4  # two ranks of 2


def full_batch(name: str, batch: dict, passes=(), **build) -> tuple[torch.Tensor, dict]:
    z = zoo.build(name, batch=BATCH, **build)
    if passes:
        opt = picofx.optimize(z.model, batch, list(passes), backend="eager", loss_fn=z.loss_fn)
        loss = opt.forward_backward(**batch)
    else:
        out = z.model(**batch) if z.loss_fn is None else z.loss_fn(z.model(batch["input_ids"]), batch["labels"])
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
    return loss.detach(), overlap_ranks.grads(z.model)


def assert_grads(actual: dict, expected: dict, **tol):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def assert_mean_loss(ranks: list, key: str, expected: torch.Tensor):
    torch.testing.assert_close(torch.stack([r[key] for r in ranks]).mean(), expected, **LOSS)


@pytest.fixture(scope="module")
def two_ranks():
    """The scenarios in one spawned group of 2 ranks (a group each cost a start, imports and fuse's
    patterns); the ones that raise on purpose get groups of their own."""
    calls = [(overlap_ranks.reference_llama_checks, BATCH), (overlap_ranks.hf_llama_checks, BATCH),
             (overlap_ranks.precision_checkpoint_checks, BATCH), (overlap_ranks.inductor_checks, BATCH)]
    return run_scenarios(calls, 2, timeout=1600, collective_timeout=300)


@pytest.fixture(scope="module")
def llama_ranks(two_ranks):
    return two_ranks["reference_llama_checks"]


def test_reference_llama_matches_full_batch(llama_ranks):
    example = zoo.build("llama-tiny", batch=BATCH).example_inputs
    loss, expected = full_batch("llama-tiny", example)
    assert_mean_loss(llama_ranks, "loss", loss)
    for r in llama_ranks:
        assert_grads(r["grads"], expected, **GRAD)
    assert llama_ranks[0]["notes"]["buckets"] > 2, llama_ranks[0]["notes"]


def test_backward_graph_waits_after_compute(llama_ranks):
    order, ops = llama_ranks[0]["order"], llama_ranks[0]["ops"]
    issued = [i for i, kind in enumerate(order) if kind == "all_reduce"]
    waits = [i for i, kind in enumerate(order) if kind == "wait"]
    assert len(issued) == len(waits) == llama_ranks[0]["notes"]["buckets"]
    # the first bucket is issued before the backward's last compute, and its wait comes after that compute
    assert any(kind == "compute" for kind in order[issued[0] + 1:waits[0]])
    assert min(waits) > max(i for i, kind in enumerate(order) if kind == "compute")
    assert ops["aten.div.Tensor"] >= len(issued)


def test_no_sync_accumulates_then_all_reduces_the_sum(llama_ranks):
    example = zoo.build("llama-tiny", batch=BATCH).example_inputs
    _, first = full_batch("llama-tiny", example)
    _, second = full_batch("llama-tiny", overlap_ranks.later_batch(example, 3))
    local = [r["local_grads"] for r in llama_ranks]
    assert any(not torch.equal(local[0][n], local[1][n]) for n in local[0]), "no_sync must not communicate"
    for r in llama_ranks:  # DDP: average over ranks of each rank's sum over micro-batches
        assert_grads(r["accumulated"], {n: first[n] + second[n] for n in first}, **GRAD)
        assert_grads(r["after_accumulation"], second, rtol=1e-3, atol=1e-5)  # a difference of sums


def test_optimizer_steps_keep_replicas_identical(llama_ranks):
    a, b = (r["params"] for r in llama_ranks)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert llama_ranks[0]["state_dict_keys"][0] == llama_ranks[0]["state_dict_keys"][1]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def test_bf16_compression(llama_ranks):
    """All-reduce in bf16: each rank's gradient is rounded to bf16 (relative error <= 2^-9) before
    the sum, and the sum is rounded again. DDP's bf16_compress_hook divides in bf16 before the sum,
    picofx divides in fp32 after it; an element whose ranks' gradients nearly cancel can differ by a
    bf16 rounding of the addends, so the stated tolerance is per gradient tensor, normwise:
    ||picofx - DDP bf16|| <= 2^-8 ||DDP bf16|| and ||picofx - fp32 full batch|| <= 2^-7 ||fp32||."""
    example = zoo.build("llama-tiny", batch=BATCH, seed=1).example_inputs
    _, fp32 = full_batch("llama-tiny", example, seed=1)
    for r in llama_ranks:
        assert r["bf16_casts"] >= 2
        for name, g in fp32.items():
            assert relative_error(r["bf16_grads"][name], r["ddp_bf16_grads"][name]) <= 2**-8, name
            assert relative_error(r["bf16_grads"][name], g) <= 2**-7, name
        assert any(not torch.equal(r["bf16_grads"][n], fp32[n]) for n in fp32), "nothing was compressed"


def test_hf_llama_and_recapture_match_full_batch(two_ranks):
    z = zoo.build("hf-llama-tiny", batch=BATCH)
    ranks = two_ranks["hf_llama_checks"]
    loss, expected = full_batch("hf-llama-tiny", z.example_inputs)
    shorter = {k: v[:, :16].contiguous() for k, v in z.example_inputs.items()}
    short_loss, short_expected = full_batch("hf-llama-tiny", shorter)
    assert_mean_loss(ranks, "loss", loss)
    assert_mean_loss(ranks, "recaptured_loss", short_loss)
    for r in ranks:
        assert_grads(r["grads"], expected, **GRAD)
        assert_grads(r["recaptured_grads"], short_expected, **GRAD)
    assert ranks[0]["link"] == ranks[1]["link"]  # every rank plans with the same measured link
    assert ranks[0]["link"]["link_bandwidth"] > 0 and ranks[0]["link"]["link_latency"] > 0
    assert ranks[0]["link"]["link_source"] == "measured"


def test_with_precision_and_checkpoint(two_ranks):
    """bf16 matmuls round per row alike in a half batch and the full one; tolerance that of precision."""
    z = zoo.build("llama-tiny", batch=BATCH)
    ranks = two_ranks["precision_checkpoint_checks"]
    assert {"fuse", "precision", "checkpoint", "overlap"} <= set(ranks[0]["passes"])
    loss, expected = full_batch("llama-tiny", z.example_inputs,
                                passes=["fuse", "precision", picofx.passes.Checkpoint(budget=0.9)])
    torch.testing.assert_close(torch.stack([r["loss"] for r in ranks]).mean(), loss, rtol=1e-2, atol=1e-3)
    for r in ranks:
        for name, g in expected.items():
            assert (r["grads"][name] - g).norm() <= 2e-2 * g.norm() + 1e-6, name


def test_layout_mismatch_raises_on_every_rank():
    errors = run_ranks(overlap_ranks.mismatched_layout, 2, timeout=240, collective_timeout=30, expect_errors=True)
    for error in errors:
        assert error is not None and "bucket layout differs" in error
        assert "decoder_layers.1.mlp.up_proj.weight" in error, error



def test_different_warmups_raise_on_every_rank():
    errors = run_ranks(overlap_ranks.mismatched_warmup, 2, timeout=240, collective_timeout=30, expect_errors=True)
    assert "warmup=1 here, 2 on rank 1" in errors[0] and "warmup=2 here, 1 on rank 0" in errors[1], errors


def test_no_process_group_says_how_to_launch():
    z = zoo.build("llama-tiny", batch=2)
    with pytest.raises(picofx.PassError, match="launch with torchrun and call torch.distributed.init_process_group"):
        picofx.optimize(z.model, z.example_inputs, ["overlap"], backend="eager", loss_fn=z.loss_fn)


def test_inductor_matches_full_batch_and_keeps_waits_late(two_ranks):
    z = zoo.build("llama-tiny", batch=BATCH)
    ranks = two_ranks["inductor_checks"]
    loss, expected = full_batch("llama-tiny", z.example_inputs)
    _, second = full_batch("llama-tiny", overlap_ranks.later_batch(z.example_inputs, 3))
    assert_mean_loss(ranks, "loss", loss)
    for r in ranks:
        assert_grads(r["grads"], expected, **GRAD)
        assert_grads(r["accumulated"], {n: expected[n] + second[n] for n in expected}, **GRAD)
    backward = next(c for c in ranks[0]["code"] if "all_reduce_" in c or "all_reduce(" in c)
    lines = backward[backward.index("def call("):].splitlines()
    issue = [i for i, line in enumerate(lines) if re.search(r"_c10d_functional\.all_reduce_?\.default", line)]
    wait = [i for i, line in enumerate(lines) if "wait_tensor" in line]
    kernels = [i for i, line in enumerate(lines) if re.search(r"(cpp_fused_\w+|extern_kernels\.\w+)\(", line)]
    assert issue and wait
    assert any(issue[0] < k < wait[0] for k in kernels), "Inductor moved the first wait next to its all-reduce"


def test_bucket_plans():
    link = Link("test", bandwidth=1e9, latency=1e-5)
    grads = [Gradient(f"g{i}", 4 << 20, ready=0.01 * (i + 1)) for i in range(10)]  # 4 MiB every 10 ms
    assert fixed_bounds(grads, 10 << 20, 1 << 20) == [0, 3, 6, 9]
    plan = plan_buckets(grads, 0.1, 8, link, 1 << 20)
    one = all_reduce_seconds(4 << 20, 8, link)
    assert one == pytest.approx(14 / 8 * (4 << 20) / 1e9 + 14 * 1e-5)
    assert plan.buckets[0].last == 0 and plan.exposed_seconds < all_reduce_seconds(40 << 20, 8, link)
    assert sum(b.nbytes for b in plan.buckets) == 40 << 20
    # NVLink vs InfiniBand: eight ranks in a node, sixty-four across nodes
    assert all_reduce_seconds(1 << 30, 64, H100.inter_node_link) > all_reduce_seconds(1 << 30, 8, H100.intra_node_link)


def test_options_are_checked():
    with pytest.raises(ValueError, match="compress"):
        Overlap(compress="int4")
    assert copy.copy(Overlap(bucket="25MiB")).bucket == "25MiB"
