"""picofx.profile on one's own loop: a trace file named by rank, a breakdown of each traced step that
adds up to it, and the profiler off outside its window (no profiler running, no range recorded);
on CUDA the crash records armed (checked with CUDA's functions stood in for on a CPU)."""
import json
import os

import pytest
import torch

import picofx
from picofx.diagnose import profiler as profiler_module
from picofx.diagnose.breakdown import COMPONENTS


def test_a_few_steps_traced_and_the_profiler_off_outside_them(tmp_path, monkeypatch):
    ranges = []
    record_function = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: ranges.append(name) or record_function(name))
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    seen = []  # per step: whether the profiler ran, and how many ranges were recorded
    with picofx.profile(steps=2, wait=1, warmup=1, directory=tmp_path, rank=3) as prof:
        prof.wrap(optimizer, "step", "optimizer")  # the optimizer's own step, in the optimizer range
        for _ in range(6):
            before = len(ranges)
            with prof.phase("data"):
                x = torch.randn(32, 64)
            with prof.phase("forward_backward"):
                model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.append((torch.autograd.profiler._is_profiler_enabled, len(ranges) - before))
            prof.step()
    assert [on for on, _ in seen] == [False, False, True, True, False, False]
    assert [count for _, count in seen] == [0, 0, 3, 3, 0, 0]  # data, forward_backward, optimizer
    trace = json.loads((tmp_path / "rank3.pt.trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"picofx.data", "picofx.forward_backward", "picofx.optimizer"} <= names
    assert len(prof.breakdowns) == 2
    for step in prof.breakdowns:
        assert sum(step.parts[k] for k in COMPONENTS) == pytest.approx(step.seconds, rel=1e-9)
        assert step.parts["forward"] > 0 and step.parts["backward"] > 0 and step.parts["optimizer"] > 0
        assert "unattributed" in step.parts
    assert "a step: " in prof.summary() and "unattributed" in prof.summary()


def test_a_run_shorter_than_the_window_is_traced_to_its_end_and_bad_arguments(tmp_path):
    with picofx.profile(steps=3, wait=0, warmup=0, directory=tmp_path) as prof:
        assert prof.recording
        torch.ones(4).sum()
    assert not prof.recording and len(prof.breakdowns) == 1  # closed in the window: its step is traced
    try:
        picofx.profile(steps=0)
    except ValueError as e:
        assert "steps must be at least 1" in str(e)
    else:
        raise AssertionError("picofx.profile(steps=0) was accepted")


def test_on_cuda_an_out_of_memory_error_leaves_a_snapshot_and_a_hang_the_flight_recorder(tmp_path, monkeypatch):
    assert profiler_module.crash_records(tmp_path, 0) == []  # a CPU: nothing armed
    calls, observers = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)
    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    armed = profiler_module.crash_records(tmp_path, 2)
    assert len(armed) == 2 and calls == [("record", {"max_entries": 100_000})]
    assert int(os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")
    observers[0](0, 2**30, 2**34, 0)  # what the allocator calls when an allocation fails
    assert calls[-1] == ("dump", str(tmp_path / "memory_rank2.pickle"))
