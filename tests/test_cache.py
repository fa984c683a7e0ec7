"""The on-disk cache of optimized graphs (picofx.runtime.cache): a second identical optimize loads
the graph instead of capturing and running the passes, and trains exactly like the first."""
import os
import subprocess
import sys

import pytest
import torch

import picofx
from picofx.capture.export import input_key
from picofx.models import zoo
from picofx.passes import Checkpoint
from picofx.runtime import cache
from picofx.runtime.cache import GraphCache, NotCacheable, cache_key

PASSES = ["fuse", Checkpoint(budget=0.95)]  # 95% of the peak: checkpoint tags nodes, the hit replays them
# (64 tokens: at 16, parameters, gradients and the loss set the peak and nothing recomputed lowers it)


def optimized_step(passes=PASSES, seq=64, model="llama-tiny", **kwargs):
    torch.manual_seed(0)
    z = zoo.build(model, batch=2, seq=seq)
    opt = picofx.optimize(z.model, z.example_inputs, passes, backend="eager", loss_fn=z.loss_fn, **kwargs)
    out = opt(**z.example_inputs)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return opt, loss.detach(), {n: p.grad for n, p in z.model.named_parameters()}


def use_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PICOFX_CACHE", "1")
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path))
    captures = []
    optimize_module = sys.modules["picofx.api"]  # the module, not the function of its name
    capture = optimize_module.capture_call
    monkeypatch.setattr(optimize_module, "capture_call", lambda *a, **k: captures.append(1) or capture(*a, **k))
    return captures


def test_second_run_loads_the_graph_and_trains_alike(monkeypatch, tmp_path):
    captures = use_cache(monkeypatch, tmp_path)
    first, loss, grads = optimized_step()
    assert first.report.sections["cache"].startswith("miss; saved to ")
    assert len(captures) == 1 and len(list(tmp_path.glob("*.pt"))) == 1
    second, cached_loss, cached_grads = optimized_step()
    assert second.report.sections["cache"].startswith("hit"), second.report.sections
    assert len(captures) == 1  # not captured again
    torch.testing.assert_close(cached_loss, loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(cached_grads[name], grad, rtol=0, atol=0, msg=name)
    for role in ("forward", "backward"):  # checkpoint's recompute decisions replayed: the same graphs
        assert second.graphs[role].code == first.graphs[role].code, role
    assert [r.name for r in second.report.records] == ["fuse", "checkpoint"]


def test_cache_off_and_corrupt_entries(monkeypatch, tmp_path):
    captures = use_cache(monkeypatch, tmp_path)
    monkeypatch.setenv("PICOFX_CACHE", "0")
    opt, _, _ = optimized_step(["fuse"])
    assert "cache" not in opt.report.sections and not list(tmp_path.iterdir())
    monkeypatch.setenv("PICOFX_CACHE", "1")
    optimized_step(["fuse"])
    (entry,) = tmp_path.glob("*.pt")
    entry.write_bytes(b"not a cache entry")
    opt, loss, _ = optimized_step(["fuse"])
    assert opt.report.sections["cache"].startswith("miss (an unreadable entry, rewritten"), opt.report.sections
    assert len(captures) == 3 and torch.isfinite(loss)
    opt, _, _ = optimized_step(["fuse"])
    assert opt.report.sections["cache"].startswith("hit") and len(captures) == 3


def test_key_covers_passes_options_shapes_and_weights():
    z = zoo.build("llama-tiny", batch=2, seq=16)

    def key(model=z.model, passes=("fuse",), seq=16, options=None, backend="eager"):
        ids = torch.zeros(2, seq, dtype=torch.long)
        resolved = picofx.manager.resolve_passes(list(passes))
        return cache_key(model, input_key((), {"input_ids": ids, "labels": ids}), passes=resolved,
                         loss_fn=z.loss_fn, backend=backend, verify="invariants", instruments=(),
                         options=options or {}, cost_model=None)

    base = key()
    assert key() == base
    bigger = zoo.build("llama-tiny", batch=2, seq=16).model
    name, weight = next(bigger.named_parameters())
    owner = bigger.get_submodule(name.rpartition(".")[0])
    setattr(owner, name.rpartition(".")[2], torch.nn.Parameter(torch.zeros(weight.shape[0] + 1, *weight.shape[1:])))
    others = [key(passes=()), key(passes=("fuse", "precision")), key(passes=(picofx.passes.Fuse(keep_logits=True),)),
              key(seq=8), key(options={"gradient_sync": "no_sync"}), key(backend="inductor"), key(model=bigger)]
    assert len({base, *others}) == len(others) + 1


def test_what_is_not_cached_says_why(monkeypatch, tmp_path):
    use_cache(monkeypatch, tmp_path)
    opt, _, _ = optimized_step(["fuse"], verify="numerics")
    assert opt.report.sections["cache"] == "off: verify='numerics' checks every pass as it runs"
    assert not list(tmp_path.iterdir())


def test_a_hugging_face_model_is_cached_and_trains_alike(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    captures = use_cache(monkeypatch, tmp_path)
    first, loss, grads = optimized_step(["fuse"], model="hf-llama-tiny")
    assert first.report.sections["cache"].startswith("miss; saved to "), first.report.sections["cache"]
    second, cached_loss, cached_grads = optimized_step(["fuse"], model="hf-llama-tiny")
    assert second.report.sections["cache"].startswith("hit") and len(captures) == 1
    torch.testing.assert_close(cached_loss, loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(cached_grads[name], grad, rtol=0, atol=0, msg=name)


def test_a_save_that_fails_half_way_leaves_no_partial_file(monkeypatch, tmp_path):
    use_cache(monkeypatch, tmp_path)

    save = torch.save

    def disk_full(obj, path, *args, **kwargs):
        if not str(path).endswith(".tmp"):  # torch's own files
            return save(obj, path, *args, **kwargs)
        open(path, "wb").write(b"half an entry")
        raise OSError("No space left on device")

    monkeypatch.setattr(cache.torch, "save", disk_full)
    opt, _, _ = optimized_step(["fuse"])
    assert opt.report.sections["cache"] == "miss; not saved: OSError: No space left on device"
    assert sorted(p.suffix for p in tmp_path.iterdir() if p.suffix in (".pt", ".tmp")) == []


def test_opening_the_cache_removes_partial_files_whose_writer_died(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid now names no process
    left = tmp_path / f"{'a' * 32}.{dead.pid}.tmp"
    writing = tmp_path / f"{'b' * 32}.{os.getpid()}.tmp"  # a save in progress, by a process that runs
    entry = tmp_path / f"{'c' * 32}.pt"
    for path in (left, writing, entry):
        path.write_bytes(b"x")
    GraphCache(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([writing.name, entry.name])
