"""Fuse(choose=...): the candidates of each pointwise pattern timed on the device, the fastest kept,
the choice cached (never across devices or versions) and broadcast from rank 0; given choices; the
report. Timings are fixed (a fake timer) except in the one slow test that compiles the candidates."""
import dataclasses

import pytest
import torch

from picofx.models import zoo
from picofx.passes.fuse.fuse import Fuse
from picofx.runtime import kernel_choice
from picofx.runtime.compile import triton_lowered_ops
from picofx.runtime.kernel_choice import Choice, ChoiceCache, choose, environment, from_rank0, measure
from picofx.testing import captured, count_ops, run_pass

picofx_ops = torch.ops.picofx
CPU = torch.device("cpu")


class FakeTimer:
    """Fixed times per (pattern, candidate), in seconds; `fails` raise. Records what it timed."""

    def __init__(self, times: dict, fails=()):
        self.times, self.fails, self.calls = times, set(fails), []

    def __call__(self, pattern, candidate, run):
        self.calls.append((pattern, candidate))
        if (pattern, candidate) in self.fails:
            raise RuntimeError(f"{candidate} does not compile here")
        return self.times[pattern, candidate]


def candidates(*names):
    return {name: (lambda: None) for name in names}


def test_the_fastest_candidate_is_kept():
    timer = FakeTimer({("p", "kernel"): 3e-3, ("p", "decomposed"): 1e-3, ("p", "unfused"): 2e-3})
    choice = measure("p", candidates("kernel", "decomposed", "unfused"), timer, "cpu")
    assert choice.chosen == "decomposed" and choice.times["kernel"] == 3e-3
    assert choice.describe() == "decomposed (kernel 3.000 ms, decomposed 1.000 ms, unfused 2.000 ms)"


def test_a_failing_candidate_is_not_chosen_and_all_failing_runs_unfused_with_a_warning():
    timer = FakeTimer({("p", "decomposed"): 2e-3, ("p", "unfused"): 1e-3}, fails={("p", "unfused")})
    assert measure("p", candidates("decomposed", "unfused"), timer, "cpu").chosen == "decomposed"
    timer = FakeTimer({}, fails={("rms_norm", "kernel"), ("rms_norm", "decomposed"), ("rms_norm", "unfused")})
    with pytest.warns(UserWarning, match="every candidate for pattern 'rms_norm' failed on cpu"):
        choice = measure("rms_norm", candidates("kernel", "decomposed", "unfused"), timer, "cpu")
    assert choice.chosen == "unfused" and choice.times["kernel"].startswith("failed: RuntimeError")


SHAPES = {"p": [["((x, (2, 8), (8, 1), 'torch.float32'),)", 3]]}
TIMES = {("p", "decomposed"): 1e-3, ("p", "unfused"): 2e-3}


def test_a_cache_hit_skips_timing(tmp_path):
    first = FakeTimer(TIMES)
    chosen = choose({"p": candidates("decomposed", "unfused")}, SHAPES, device=CPU, directory=tmp_path, timer=first)
    assert chosen["p"] == Choice("decomposed", {"decomposed": 1e-3, "unfused": 2e-3}) and len(first.calls) == 2
    again = FakeTimer(TIMES)
    chosen = choose({"p": candidates("decomposed", "unfused")}, SHAPES, device=CPU, directory=tmp_path, timer=again)
    assert again.calls == [] and chosen["p"].cached and chosen["p"].chosen == "decomposed"
    other_shapes = {"p": [["((x, (4, 8), (8, 1), 'torch.float32'),)", 3]]}
    choose({"p": candidates("decomposed", "unfused")}, other_shapes, device=CPU, directory=tmp_path, timer=again)
    assert len(again.calls) == 2


@pytest.mark.parametrize("field, value", [("device", "NVIDIA H100 80GB HBM3 sm90"), ("torch", "2.0.0"),
                                          ("triton", "2.1.0")])
def test_a_cache_entry_from_another_device_or_version_is_never_used(tmp_path, monkeypatch, field, value):
    choose({"p": candidates("decomposed", "unfused")}, SHAPES, device=CPU, directory=tmp_path, timer=FakeTimer(TIMES))
    here = environment(CPU)
    monkeypatch.setattr(kernel_choice, "environment", lambda device: {**here, field: value})
    timer = FakeTimer(TIMES)
    choose({"p": candidates("decomposed", "unfused")}, SHAPES, device=CPU, directory=tmp_path, timer=timer)
    assert len(timer.calls) == 2
    # An entry whose file name matches but which records another environment (copied from another
    # machine, say) is not used either.
    cache = ChoiceCache(tmp_path)
    entry = cache.directory / f"{cache.key(here, SHAPES)}.json"
    entry.write_text(entry.read_text().replace(here["torch"], "0.0.1"))
    monkeypatch.setattr(kernel_choice, "environment", lambda device: here)
    assert cache.load(here, SHAPES) is None


def test_rank0_decides_and_every_rank_runs_its_choice(monkeypatch):
    import torch.distributed as dist

    sent = {"p": dataclasses.asdict(Choice("kernel", {"kernel": 1e-3}))}

    def broadcast_object_list(box, src):
        assert src == 0 and box == [None]  # this rank did not decide
        box[0] = sent

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    timer = FakeTimer({})
    chosen = choose({"p": candidates("kernel", "unfused")}, SHAPES, device=CPU, directory=None, timer=timer)
    assert timer.calls == [] and chosen == {"p": Choice("kernel", {"kernel": 1e-3})}
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src: None)
    assert from_rank0(lambda: {"decided": 0}) == {"decided": 0}


POINTWISE = ("rms_norm", "add_rms_norm", "swiglu", "rope")


def test_measured_choices_shape_the_graph_and_the_report(tmp_path):
    gm, ctx = captured(zoo.build("llama-tiny"))
    ctx = dataclasses.replace(ctx, cache_directory=str(tmp_path))
    times = {**{(p, "decomposed"): 1e-3 for p in POINTWISE}, **{(p, "unfused"): 2e-3 for p in POINTWISE},
             ("swiglu", "unfused"): 0.5e-3}
    timer = FakeTimer(times)
    record = run_pass(Fuse(choose="measure", timer=timer), gm, ctx)
    assert sorted({p for p, _ in timer.calls}) == sorted(POINTWISE)  # projections, attention, loss: always fused
    assert {c for _, c in timer.calls} == {"decomposed", "unfused"}  # no Triton kernel runs on CPU
    assert record.notes["kernel_choice"]["swiglu"] == "unfused (decomposed 1.000 ms, unfused 0.500 ms)"
    assert record.notes["kernel_choice"]["rms_norm"].startswith("decomposed")
    assert record.notes["swiglu"] == 0 and count_ops(gm, picofx_ops.silu_mul.default) == 0
    assert count_ops(gm, picofx_ops.rms_norm.default, picofx_ops.add_rms_norm.default) == 5
    assert {n.meta["lowering"] for n in gm.graph.nodes if n.target is picofx_ops.rms_norm.default} == {"decomposed"}

    gm, _ = captured(zoo.build("llama-tiny"))
    again = FakeTimer(times)
    record = run_pass(Fuse(choose="measure", timer=again), gm, ctx, verify="invariants")
    assert again.calls == [] and record.notes["kernel_choice"]["swiglu"].endswith(", cached")


def test_given_choices_decide_without_timing():
    gm, ctx = captured(zoo.build("llama-tiny"))
    given = {"swiglu": "unfused", "gated_activation": "unfused", "rope": "decomposed", "rms_norm": "kernel"}
    record = run_pass(Fuse(choose=given), gm, ctx)
    assert "kernel_choice" not in record.notes
    assert count_ops(gm, picofx_ops.silu_mul.default) == 0 and count_ops(gm, picofx_ops.rope.default) == 2
    assert triton_lowered_ops(gm, torch.device("cuda")) >= {"picofx::rms_norm"}
    assert "picofx::rope" not in triton_lowered_ops(gm, torch.device("cuda"))


def test_fixed_is_the_default_on_cpu():
    gm, ctx = captured(zoo.build("llama-tiny"))
    record = run_pass(Fuse(), gm, ctx, verify="invariants")
    assert "kernel_choice" not in record.notes and not [n for n in gm.graph.nodes if "lowering" in n.meta]


@pytest.mark.parametrize("choice, message", [({"no_such_rule": "kernel"}, "no rule 'no_such_rule'"),
                                             ({"rms_norm": "fast"}, "choose one of kernel, decomposed, unfused"),
                                             ("fastest", "'measure', 'fixed', or a dict")])
def test_bad_choices_are_refused_with_what_to_give(choice, message):
    with pytest.raises((KeyError, ValueError), match=message):
        Fuse(choose=choice)


@pytest.mark.slow
def test_the_candidates_compile_and_run_on_cpu(tmp_path):
    gm, ctx = captured(zoo.build("llama-tiny"))
    record = run_pass(Fuse(choose="measure", rules=("rms_norm",)), gm, dataclasses.replace(ctx, cache_directory=str(tmp_path)))
    choice = record.notes["kernel_choice"]["rms_norm"]
    assert choice.split()[0] in ("decomposed", "unfused") and "failed" not in choice, choice
