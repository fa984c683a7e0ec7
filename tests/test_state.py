"""State with an owner: a rule's traces live and die with the rule, caches are bounded, and the
device table is read when asked."""
import gc
import math
import types
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import picofx.kernels  # noqa: F401  (registers torch.ops.picofx)
from picofx.cost import device as devices
from picofx.cost.inductor import workspace
from picofx.models.zoo import ZooModel
from picofx.rewrite import matcher
from picofx.rewrite.rules import Rule, Traces, tensor
from picofx.testing import captured


def gelu_tanh_pattern(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_replacement(x, approximate="tanh"):
    return F.gelu(x, approximate=approximate)


class ProjectedGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return gelu_tanh_pattern(self.proj(x))  # (2, 4, 8)


def gelu_rule() -> Rule:
    return Rule(name="gelu_tanh", pattern=gelu_tanh_pattern, replacement=gelu_replacement,
                inputs={"x": tensor(4, 8)}, options={"approximate": "tanh"},
                tolerance=(1e-5, 1e-5), tolerance_reason="ATen's gelu evaluates it in another order")


def test_a_rules_traces_live_on_it_are_shared_by_its_copies_and_die_with_it(monkeypatch):
    gm, _ = captured(ZooModel(ProjectedGelu(), {"x": torch.randn(2, 4, 8)}, None))
    exports = []
    trace_all = matcher.trace_all
    monkeypatch.setattr(matcher, "trace_all", lambda calls: exports.append(len(calls)) or trace_all(calls))

    rule = gelu_rule()
    (match,), _ = matcher.find_matches(gm.graph, rule)
    assert len(rule.traces.patterns) == 1 and len(rule.traces.on_inputs) == 2  # pattern, replacement
    assert exports == [2]  # both on the match's inputs, in one export (the pattern itself traced in rules.py)
    matcher.find_matches(gm.graph, rule)
    assert exports == [2]  # the second search traces nothing

    exact = rule.with_options(approximate="none")
    assert exact.traces is rule.traces and exact.options == {"approximate": "none"}
    (exact_match,), _ = matcher.find_matches(gm.graph, exact)
    assert exports == [2, 1]  # only the replacement with the new option
    assert len(rule.traces.on_inputs) == 3 and exact_match.replacement is not match.replacement

    owned = weakref.ref(rule.traces)
    del rule, exact, match, exact_match
    gc.collect()
    assert owned() is None  # nothing outside the rule holds its traces


def test_a_rules_traces_keep_the_most_recent(monkeypatch):
    monkeypatch.setattr(Traces, "LIMIT", 3)
    traces = Traces()
    for i in range(3):
        traces.put(("inputs", i), ValueError(i))
    assert traces.get(("inputs", 0)) is not None  # used: now the most recent
    traces.put(("inputs", 3), ValueError(3))
    assert list(traces.on_inputs) == [("inputs", 2), ("inputs", 0), ("inputs", 3)]
    assert traces.get(("inputs", 1)) is None


def test_workspace_measurements_are_bounded(monkeypatch):
    monkeypatch.setattr(workspace, "MEASUREMENTS_KEPT", 2)
    monkeypatch.setattr(workspace, "_cache", {})
    for rows in (3, 5, 7):
        gm = make_fx(lambda x, w: torch.ops.picofx.rms_norm(x, w, 1e-6), tracing_mode="fake")(
            torch.randn(rows, 16), torch.ones(16))
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        assert workspace.workspace_bytes(node) >= 0
    assert len(workspace._cache) == 2
    assert [key[1][0][0] for key in workspace._cache] == [(5, 16), (7, 16)]  # the oldest went first


def test_the_cpu_entry_is_read_at_each_call():
    threads = torch.get_num_threads()
    assert "cpu" not in devices.DEVICES  # no snapshot taken at import
    try:
        for n, cores in ((1, "1 core"), (2, "2 cores")):
            torch.set_num_threads(n)
            assert devices.device_for("cpu") == devices.devices()["cpu"] == devices.cpu(n)
            assert devices.device_for("cpu").name == f"CPU ({cores}, nominal)"
    finally:
        torch.set_num_threads(threads)


def test_a_gpu_is_matched_by_name_against_the_table_as_it_is_now(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA B200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=183e9))
    with pytest.raises(KeyError, match="no description for 'nvidia b200'.*known: h100, h200, a100"):
        devices.device_for("cuda:0")
    b200 = devices.Device("NVIDIA B200", {torch.float32: 1e15}, 8e12, 192 * devices.GB, 900e9, 3e-6, 50e9, 10e-6)
    monkeypatch.setitem(devices.DEVICES, "b200", b200)
    monkeypatch.setitem(devices.DEVICES, "b2", devices.H100)  # a shorter key in the same name loses
    found = devices.device_for("cuda:0")
    assert found.name == "NVIDIA B200" and found.memory_capacity == 183e9 and found.peak_flops == b200.peak_flops
    assert devices.devices()["b200"] is b200
