"""picofx.runtime.attribution: a profiler trace's time per graph node, label and kind."""
import pytest
import torch
from torch import fx
from torch.profiler import ProfilerActivity, profile

import picofx
from picofx.models.zoo import build
from picofx.runtime.attribution import attribute, kind_of, sdpa_backend


@pytest.fixture(scope="module")
def traced_steps():
    m = build("hf-llama-tiny", batch=2, seq=16)
    opt = picofx.optimize(m.model, m.example_inputs, ["fuse"], backend="eager")
    opt(**m.example_inputs).loss.backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt(**m.example_inputs).loss.backward()
    return prof.events(), {role: opt.graphs[role] for role in ("forward", "backward")}


def test_the_eager_steps_ops_are_matched_to_their_graph_nodes(traced_steps):
    events, graphs = traced_steps
    result = attribute(events, graphs)
    nodes = {f"{role}.{n.name}": n for role, gm in graphs.items() for n in gm.graph.nodes}
    assert result.attributed > 0.5 * result.seconds and result.unattributed >= 0
    assert result.unmatched < 0.05 * result.attributed
    fused = {str(nodes[name].target) for name in result.by_node if nodes[name].target.namespace == "picofx"}
    assert {"picofx.rms_norm.default", "picofx.linear_cross_entropy.default"} <= fused
    assert result.by_kind["matmul"] > 0 and result.by_kind["attention"] > 0 and result.by_kind["loss"] > 0
    attention = [n for n in nodes.values() if "scaled_dot_product" in str(n.target)]  # the backward recomputes
    assert result.sdpa == {"flash (cpu)": len(attention)} and len(attention) >= 2 * 2  # 2 layers, fw and bw
    assert sum(result.by_label.values()) == pytest.approx(sum(result.by_node.values()))


def test_without_graphs_every_unit_still_has_a_kind_and_counts_as_unmatched(traced_steps):
    events, _ = traced_steps
    result = attribute(events)
    assert not result.by_node and result.unmatched == pytest.approx(result.attributed)
    assert result.by_kind["matmul"] > 0


def test_an_inductor_kernel_named_after_its_nodes_is_shared_among_them():
    graph = fx.Graph()
    x = graph.placeholder("x")
    add = graph.create_node("call_function", torch.ops.aten.add.Tensor, (x, x), name="add")
    add_1 = graph.create_node("call_function", torch.ops.aten.add.Tensor, (add, x), name="add_1")
    mul_1 = graph.create_node("call_function", torch.ops.aten.mul.Tensor, (add_1, x), name="mul_1")
    graph.output(mul_1)
    gm = fx.GraphModule(torch.nn.Module(), graph)

    class Event:  # the fields attribute() reads of a torch.autograd.profiler_util.FunctionEvent
        def __init__(self, name, us):
            self.name, self.cpu_time_total, self.device_time_total = name, us, 0
            self.cpu_parent, self.cpu_children, self.device_type = None, [], "DeviceType.CPU"

    result = attribute([Event("cpp_fused_add_1_mul_1_0", 3000.0), Event("mystery", 1000.0)], [gm])
    assert result.by_node == {"graph0.add_1": 1.5e-3, "graph0.mul_1": 1.5e-3}
    assert result.seconds == pytest.approx(3e-3)  # a root that names no work and has no children: not a step


def test_kinds_and_backends_from_names():
    assert kind_of("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "rms_norm"
    assert kind_of("triton_poi_fused_mul_silu_3") == "swiglu"
    assert kind_of("aten::mm") == "matmul" and kind_of("picofx::linear_cross_entropy") == "loss"
    assert sdpa_backend("aten::_scaled_dot_product_flash_attention_backward") == "flash"
    assert sdpa_backend("aten::_scaled_dot_product_efficient_attention") == "efficient"
    assert sdpa_backend("aten::mm") is None
