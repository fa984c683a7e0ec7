"""Gradient compression in the overlap pass (picofx.compression's codecs as all-reduces) on two
gloo ranks.

One spawn runs every compressor on the reference LLaMA (tests/passes/compress_ranks.py); the
comparisons happen here. Tolerances: sparse_rows is exact up to fp32 summation order (rtol 1e-5);
int8 (blocks of 256, quantized twice) within 3% per gradient tensor, normwise; every lossy
compressor leaves both ranks with bit-identical gradients."""
from __future__ import annotations

import pytest
import torch

from picofx.passes import Overlap
from picofx.compression import Int8, PowerSGD, TopK, parse_compress

import compress_ranks
from compress_ranks import relative_error
from spawn_ranks import run_ranks

BATCH = 4  # two ranks of 2
EXACT = dict(rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("compress_dcp"))
    return run_ranks(compress_ranks.compressor_checks, 2, BATCH, directory, timeout=420)


def assert_identical_on_ranks(ranks, kind: str, *steps: str):
    for step in steps:
        a, b = ranks[0][kind][step], ranks[1][kind][step]
        for name in a:
            assert torch.equal(a[name], b[name]), f"{kind} {step} {name} differs between ranks"


def test_sparse_rows_equals_uncompressed(ranks):
    for r in ranks:
        for step in ("first", "second"):
            for name, g in r["None"][step].items():
                torch.testing.assert_close(r["sparse_rows"][step][name], g, **EXACT, msg=lambda m, n=name: f"{n}: {m}")
        notes = r["sparse_rows"]["notes"]
        assert notes["embedding_rows"].startswith("sparse: embedding.weight"), notes["embedding_rows"]
        rows = [b for b in notes["compression"] if b["compressor"] == "sparse_rows"]
        assert len(rows) == 1 and rows[0]["wire_bytes"] < rows[0]["fp32_ring_bytes"] / 3


def test_tied_embedding_stays_dense(ranks):
    for r in ranks:
        notes = r["tied"]["sparse_rows"]["notes"]
        assert notes["embedding_rows"].startswith("dense:") and "tied" in notes["embedding_rows"], notes
        assert all(b["compressor"] == "none" for b in notes["compression"])
        for name, g in r["tied"]["None"]["grads"].items():
            torch.testing.assert_close(r["tied"]["sparse_rows"]["grads"][name], g, **EXACT)


def test_int8_close_to_uncompressed_and_identical_on_ranks(ranks):
    for kind in ("sparse_rows+int8", "int8:ef"):
        assert_identical_on_ranks(ranks, kind, "first", "second")
        for name, g in ranks[0]["None"]["first"].items():
            assert relative_error(ranks[0][kind]["first"][name], g) <= 0.03, (kind, name)
        head = "final_proj.weight"
        assert not torch.equal(ranks[0][kind]["first"][head], ranks[0]["None"]["first"][head])
    assert ranks[0]["sparse_rows+int8"]["notes"]["wire_ratio"] <= 0.30
    assert ranks[0]["int8:ef"]["notes"]["wire_ratio"] <= 0.30


@pytest.mark.parametrize("kind", ["topk:0.01", "powersgd:4", "int8:ef"])
def test_error_feedback_carries_over_and_resets(ranks, kind):
    assert_identical_on_ranks(ranks, kind, "first", "second", "second_after_reset")
    for r in ranks:
        result = r[kind]
        residuals = {k: v for k, v in result["state"].items() if k.startswith("residual/")}
        assert residuals and any(v.abs().sum() > 0 for v in residuals.values())
        assert all(v.abs().sum() == 0 for k, v in result["reset_state"].items() if k.startswith("residual/"))
        for key, value in result["state"].items():  # DCP restored each rank's own residuals and the shared Q
            assert torch.equal(result["loaded_state"][key], value), key
        # the second step sent last step's residual too; after the reset it does not
        assert any(not torch.equal(result["second"][n], result["second_after_reset"][n]) for n in result["second"])
    if kind == "powersgd:4":  # Q is warm-started: the same on both ranks, not its first value after a step
        q = [k for k in ranks[0][kind]["state"] if k.startswith("powersgd")]
        assert q and all(torch.equal(ranks[0][kind]["state"][k], ranks[1][kind]["state"][k]) for k in q)
        assert any(not torch.equal(ranks[0][kind]["state"][k], ranks[0][kind]["reset_state"][k]) for k in q)



def test_the_report_gives_each_compressed_buckets_relative_error(ranks):
    """After a step, opt.report's compression notes carry each lossy bucket's relative error: for
    error feedback, the residual it left over this rank's own gradient, recomputed here."""
    for r in ranks:
        errors = r["errors"]
        for kind in ("int8:ef", "topk:0.01", "powersgd:4"):
            found = errors[kind]
            assert found["expected"] and found["expected"].keys() <= found["reported"].keys(), kind
            for k, value in found["expected"].items():
                assert found["reported"][k] == pytest.approx(value, rel=1e-3, abs=1e-6), (kind, k)
        # each entry within half a step (absmax / 254) of its block's: at most sqrt(256) / 254 normwise
        assert all(0 < e <= 16 / 254 for e in errors["int8:ef"]["reported"].values()), errors["int8:ef"]
        assert all(0.5 < e < 1 for e in errors["topk:0.01"]["reported"].values())  # 99% of the entries stay behind
        assert all(0 < e <= 2 ** -8 for e in errors["bf16"]["reported"].values())  # bf16's 8-bit mantissa
        mixed = errors["sparse_rows+int8"]
        assert all((e is None) == (mixed["compressor"][k] == "sparse_rows") for k, e in mixed["reported"].items())

def test_warmup_steps_run_uncompressed(ranks):
    """Overlap(warmup=1): the first synced step is the uncompressed average; the next is compressed;
    reset_compression starts the warm-up again."""
    warm, dense = ranks[0]["warmup"], ranks[0]["None"]
    assert warm["variants"] == ["sync", "sync_uncompressed"]
    for name, g in dense["first"].items():
        torch.testing.assert_close(warm["first"][name], g, **EXACT)
        torch.testing.assert_close(warm["second_after_reset"][name], dense["second"][name], **EXACT)
    assert all(v.abs().sum() == 0 for v in warm["residual_after_first"].values())
    assert any(relative_error(warm["second"][n], dense["second"][n]) > 0.1 for n in dense["second"])


def test_powersgd_starts_with_two_int8_steps(ranks):
    """powersgd:4 by default: its first two synced steps go as int8 (gradients as int8's, residuals
    and Q untouched); the third step is PowerSGD's, the same on both ranks."""
    for r in ranks:
        start = r["start"]
        assert start["variants"] == ["sync", "sync_uncompressed"]
        assert any(n.get("start") == "the first 2 synced steps as int8 (start of powersgd:4)" for n in start["notes"])
        for name, g in r["int8:ef"]["first"].items():  # int8's first step: no residual yet, as int8:ef's
            torch.testing.assert_close(start["steps"][0][name], g, **EXACT)
        for state in start["states"][:2]:
            assert all(v.abs().sum() == 0 for k, v in state.items() if k.startswith("residual/"))
            assert all(torch.equal(state[k], q) for k, q in start["first_q"].items())
        assert any(v.abs().sum() > 0 for k, v in start["states"][2].items() if k.startswith("residual/"))
        assert any(not torch.equal(start["states"][2][k], q) for k, q in start["first_q"].items())
    for step in range(3):
        a, b = ranks[0]["start"]["steps"][step], ranks[1]["start"]["steps"][step]
        assert all(torch.equal(a[n], b[n]) for n in a), step


def test_wire_bytes_against_fp32_ring(ranks):
    notes = {kind: ranks[0][kind]["notes"] for kind in compress_ranks.KINDS if kind}
    assert notes["topk:0.01"]["wire_ratio"] <= 0.05
    assert notes["powersgd:4"]["wire_ratio"] < 0.5
    assert notes["sparse_rows"]["wire_ratio"] < 1.0
    for n in notes.values():
        assert n["wire_bytes"] == sum(b["wire_bytes"] for b in n["compression"])


def test_compress_spellings():
    assert parse_compress("sparse_rows+int8").rows and parse_compress("sparse_rows+int8").other == Int8()
    assert parse_compress("int8:ef").other == Int8(feedback=True)
    assert parse_compress("topk:0.01").other == TopK(0.01) and parse_compress("powersgd:4").other == PowerSGD(4)
    assert parse_compress("sparse_rows").rows and not parse_compress("bf16").rows
    for bad in ("int4", "topk:2", "topk:x", "powersgd:0", "sparse_rows+int8+topk:0.1", "int8+sparse_rows", 8):
        with pytest.raises(ValueError, match="compress"):
            Overlap(compress=bad)
    with pytest.raises(ValueError, match="warmup"):
        Overlap(compress="powersgd:4", warmup=-1)
    with pytest.raises(ValueError, match="start"):
        Overlap(compress="powersgd:4", start=1.5)


def test_block_layout_keeps_tensors_apart():
    codec = Int8(block=256)
    shapes = [(64,), (32, 64), (300,)]
    assert codec.starts(shapes) == [0, 256, 2304, 2816]
    assert codec.padded(shapes, 2) == 3072  # a whole number of blocks per rank
    assert codec.wire_bytes(shapes, 4, 2) == 3072 + 4 * 12  # int8 and fp32 scales, half each way


@pytest.mark.slow
def test_training_converges_like_uncompressed():
    """80 AdamW steps (lr 3e-3) on fresh random token walks, mean loss of the last 20 steps
    against uncompressed (PowerSGD with its default int8 start). Measured at 80: sparse_rows equal,
    int8 1.0004x; from the first step, top-k 1.36x and PowerSGD 1.22x; after uncompressed warm-up steps (torch's start_powerSGD_iter),
    half the run for top-k 1.15x, a quarter for PowerSGD 1.13x (at 200 steps, warm-ups of 100 and
    50: 1.03x and 1.07x; tools/bench_compress.py). The bounds are those with some room."""
    kinds = (None, "sparse_rows", "int8", "topk:0.01", "powersgd:4", ("topk:0.01", 40), ("powersgd:4", 20))
    ranks = run_ranks(compress_ranks.training_losses, 2, 8, kinds, 80, 3e-3, timeout=480)
    mean = {k: sum(v["losses"][-20:]) / 20 for k, v in ranks[0].items()}
    base = mean["None"]
    assert base < ranks[0]["None"]["losses"][0] - 1.0  # it learns
    assert mean["sparse_rows"] == pytest.approx(base, rel=1e-4)
    assert mean["int8"] == pytest.approx(base, rel=0.01)
    assert mean["powersgd:4"] < 1.3 * base and mean["topk:0.01"] < 1.45 * base
    warm_topk, warm_powersgd = mean["('topk:0.01', 40)"], mean["('powersgd:4', 20)"]
    assert warm_topk < min(1.22 * base, mean["topk:0.01"]) and warm_powersgd < min(1.2 * base, mean["powersgd:4"])
    for kind in kinds[2:]:  # replicas stay bit-identical through the optimizer
        a, b = ranks[0][str(kind)]["params"], ranks[1][str(kind)]["params"]
        assert all(torch.equal(a[n], b[n]) for n in a), kind


@pytest.mark.slow
def test_inductor_keeps_the_collectives():
    kinds = ("sparse_rows+int8", "topk:0.01", "powersgd:4")
    ranks = run_ranks(compress_ranks.inductor_checks, 2, BATCH, kinds, timeout=590, collective_timeout=300)
    eager = run_ranks(compress_ranks.inductor_checks, 2, BATCH, kinds, "eager", timeout=300)
    assert ranks[0]["sparse_rows+int8"]["notes"]["embedding_rows"].startswith("sparse"), "Inductor's embedding backward"
    for kind in kinds:  # the residuals were written by the compiled code (Inductor mutates the state in place)
        residuals = [v for k, v in ranks[0][kind]["state"].items() if k.startswith("residual/")]
        assert kind == "sparse_rows+int8" or any(v.abs().sum() > 0 for v in residuals), kind
        code = "\n".join(ranks[0][kind]["code"])
        assert "all_to_all_single" in code or "all_gather_into_tensor" in code or "all_reduce" in code, kind
        for step in ("first", "second"):
            for name, g in eager[0][kind][step].items():
                assert relative_error(ranks[0][kind][step][name], g) <= 1e-3, (kind, step, name)
                assert torch.equal(ranks[0][kind][step][name], ranks[1][kind][step][name]), (kind, name)
        # the relative errors are written by the compiled code too (Inductor inlines a buffer of up to 8
        # elements as a constant unless the graph module lists it as mutated)
        errors, expected = ranks[0][kind]["errors"], eager[0][kind]["errors"]
        assert expected and errors.keys() == expected.keys() and all(e > 0 for e in expected.values()), kind
        for bucket, e in expected.items():
            assert errors[bucket] == pytest.approx(e, rel=1e-2), (kind, bucket)
