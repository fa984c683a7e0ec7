"""The data-parallel gradient exchange compressed beside model parallelism, on four gloo ranks:
dp 2 x tp 2 (the tensor-parallel pieces' gradients exchanged over each piece's dp group) and dp 2 x
pp 2 (each stage's gradients over its dp group, in every micro-batch's backward).

Compared with one process running both replicas' halves of the batch: the loss exactly; the gathered
gradients at rtol 1e-4 without a compressor and with sparse_rows (exact up to the order of fp32
sums), and with bf16 within 2^-8 normwise per tensor (each rank's gradient rounded to bf16's 8-bit
mantissa once, half an ulp: 2^-9 per entry, so 2^-8 leaves room). The lossy compressors train, leave
the replicas bit-identical, and their state goes through a DCP save, a reset and a load to give the
next step bit for bit."""
from __future__ import annotations

import pytest
import torch

import compress_parallel_ranks as ranks_module
from compress_parallel_ranks import LOSSY, REFUSED, model, replica_batch
from picofx.parallel.launch import run_ranks

pytestmark = pytest.mark.slow  # four ranks, 2 layouts x 6 compressors: minutes on 2 cores


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("compress_parallel_dcp"))
    return run_ranks(ranks_module.compressed_exchanges, 4, directory, timeout=1500, collective_timeout=300)


@pytest.fixture(scope="module")
def reference():
    """One process: each replica's loss, and the gradients of the two halves' mean loss."""
    z = model()
    losses, grads = [], {}
    for replica in (0, 1):
        batch = replica_batch(z, replica)
        z.model.zero_grad(set_to_none=True)
        loss = z.loss_fn(z.model(batch["input_ids"]), batch["labels"])
        loss.backward()
        losses.append(loss.detach())
        for n, p in z.model.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / 2
    return losses, grads


def normwise(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("layout", ["tp", "pp"])
@pytest.mark.parametrize("kind", [None, "sparse_rows", "bf16"])
def test_lossless_exchanges_equal_one_process(ranks, reference, layout, kind):
    losses, expected = reference
    for rank in ranks:
        result = rank[f"{layout} {kind}"]
        torch.testing.assert_close(result["loss"], losses[result["replica"]], rtol=1e-5, atol=0)
        assert result["grads"], "every rank holds some gradients"
        for name, g in result["grads"].items():
            if kind == "bf16":
                assert normwise(g, expected[name]) <= 2 ** -8, (layout, name)
            else:
                torch.testing.assert_close(g, expected[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert result["notes"]["compress"] == kind


@pytest.mark.parametrize("layout,kind", [(layout, kind) for layout in ("tp", "pp") for kind in LOSSY
                                         if (layout, kind) not in REFUSED])
def test_lossy_exchanges_train_and_resume_from_dcp(ranks, reference, layout, kind):
    losses, expected = reference
    by_pieces: dict = {}
    for rank in ranks:
        result = rank[f"{layout} {kind}"]
        torch.testing.assert_close(result["loss"], losses[result["replica"]], rtol=1e-5, atol=0)
        assert result["notes"]["wire_ratio"] < 1
        for name in result["third"]:  # the step after a DCP save, reset and load equals the one before
            assert torch.equal(result["third"][name], result["third_resumed"][name]), (layout, kind, name)
        by_pieces.setdefault(tuple(sorted(result["grads"])), []).append(result)
        if kind == "int8:ef":
            assert all(normwise(g, expected[n]) <= 0.03 for n, g in result["grads"].items())
    for same in by_pieces.values():  # the ranks holding the same parameters end with the same gradients
        assert {r["replica"] for r in same} == {0, 1}
        assert all(torch.equal(r["grads"][n], same[0]["grads"][n]) for r in same for n in r["grads"]), (layout, kind)


def test_each_ranks_state_is_saved_under_its_own_keys(ranks):
    """Tensor-parallel ranks hold other pieces under the same parameter names: PowerSGD's Q is
    saved under the ranks that share it, each rank's residuals under its global rank."""
    keys = [set(rank["tp powersgd:2"]["keys"]) for rank in ranks]
    for r, mine in enumerate(keys):
        assert all(k.startswith((f"rank{r}/", "ranks")) for k in mine), sorted(mine)[:3]
    assert {k.split("/")[0] for k in keys[0] if k.startswith("ranks")} == {"ranks0_2"}


def test_warmup_under_a_pipeline_is_refused_by_name(ranks):
    for rank in ranks:
        assert "drop warmup under Pipeline" in rank["pp warmup"], rank["pp warmup"]
