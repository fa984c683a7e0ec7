import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import picofx
from picofx.models import zoo
from picofx.manager.verify import ANNOTATIONS

aten = torch.ops.aten
MODELS = ["llama-tiny", "hf-llama-tiny", "gpt2-tiny"]


@pytest.fixture(scope="module", params=MODELS)
def captured(request):
    z = zoo.build(request.param)
    return request.param, z, picofx.capture.capture(z.model, z.example_inputs, z.loss_fn)


def test_every_node_is_annotated(captured):
    _, _, gm = captured
    for node in gm.graph.nodes:
        if node.op != "output":
            assert all(key in node.meta for key in ANNOTATIONS), node.name


def test_parameters_are_the_models_own_placeholders(captured):
    _, z, gm = captured
    assert list(gm.parameters()) == []
    slots = [n.meta["picofx_input"] for n in gm.graph.nodes if n.op == "placeholder"]
    params = {id(z.model.get_parameter(slot.target)) for slot in slots if slot.kind == "parameter"}
    assert params == {id(p) for p in z.model.parameters()}  # tied weights resolve to one Parameter


def test_flops_match_flop_counter_on_the_eager_step(captured):
    _, z, gm = captured
    with FlopCounterMode(display=False) as counter:
        if z.loss_fn is None:
            z.model(**z.example_inputs)
        else:
            inputs = {k: v for k, v in z.example_inputs.items() if k != "labels"}
            z.loss_fn(z.model(**inputs), z.example_inputs["labels"])
    assert sum(n.meta.get("flops", 0) for n in gm.graph.nodes) == counter.get_total_flops()


def test_linear_nodes_name_their_module(captured):
    name, z, gm = captured
    paths = [n.meta["module_path"] for n in gm.graph.nodes if n.target is aten.linear.default]
    expected_first = {"llama-tiny": "decoder_layers.0.attention.q_proj",
                      "hf-llama-tiny": "model.layers.0.self_attn.q_proj",
                      "gpt2-tiny": "h.0.attn.c_attn"}[name]
    assert paths[0] == expected_first
    q = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    assert q.meta["val"].dtype == torch.float32
    assert q.meta["bytes"] == q.meta["val"].numel() * 4
    batch, seq = z.example_inputs["input_ids"].shape
    weight = q.args[1].meta["val"]
    assert q.meta["flops"] == 2 * batch * seq * weight.shape[0] * weight.shape[1]


def test_loss_is_inside_the_graph(captured):
    _, _, gm = captured
    assert any(n.target is aten._log_softmax.default for n in gm.graph.nodes)


def test_loss_fn_needs_labels():
    z = zoo.build("llama-tiny")
    with pytest.raises(picofx.CaptureError, match="labels"):
        picofx.capture.capture(z.model, {"input_ids": z.example_inputs["input_ids"]}, z.loss_fn)


class DataDependentBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:  # depends on the values
            return y.relu().sum()
        return y.sum()


class WrapsBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = DataDependentBranch()

    def forward(self, x):
        return self.inner(x)


def test_data_dependent_branch_error_names_file_line_module_and_fix():
    with pytest.raises(picofx.CaptureError) as info:
        picofx.capture.capture(WrapsBranch(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "test_capture.py:" in message and "if y.sum() > 0" in message
    assert "module 'inner'" in message
    assert "control flow" in message and "torch.cond" in message


@torch.library.custom_op("picofx_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class UsesOpaqueOp(nn.Module):
    def forward(self, x):
        return opaque(x).sum()


def test_op_without_fake_implementation_says_to_register_one():
    with pytest.raises(picofx.CaptureError, match="fake") as info:
        picofx.capture.capture(UsesOpaqueOp(), (torch.randn(3),))
    assert "test_capture.py:" in str(info.value)


def test_cache_output_says_use_cache_false():
    z = zoo.hf_llama("tiny", use_cache=True)  # the config's is off while capturing, the call's is kept
    with pytest.raises(picofx.CaptureError, match="use_cache=False"):
        picofx.capture.capture(z.model, {"input_ids": z.example_inputs["input_ids"], "use_cache": True})


@pytest.mark.parametrize("name, model_class", [("hf-llama-tiny", "LlamaForCausalLM"), ("llama-tiny", "Llama")])
def test_a_sequence_over_the_position_limit_is_refused_before_tracing(name, model_class):
    limit = zoo.build(name).model.config.max_position_embeddings
    z = zoo.build(name, seq=limit + 1)
    calls = []
    z.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(picofx.CaptureError) as info:
        picofx.capture.capture(z.model, z.example_inputs, z.loss_fn)
    message = str(info.value)
    assert "\n" not in message and calls == []  # one line, and the model never ran
    assert f"input_ids has {limit + 1} positions" in message
    assert f"max_position_embeddings={limit} (in {model_class}.config)" in message
    assert f"max_position_embeddings >= {limit + 1}" in message


def test_a_sequence_at_the_position_limit_is_captured():
    z = zoo.build("hf-llama-tiny", seq=zoo.build("hf-llama-tiny").model.config.max_position_embeddings)
    gm = picofx.capture.capture(z.model, z.example_inputs)
    assert any(n.target is aten._log_softmax.default for n in gm.graph.nodes)
