"""After `fuse`, the projections read the model's parameters as they are: the forward graph copies
no weight into a concatenation each step, and the backward concatenates no gradients to feed a
merged matmul; the loss and every gradient stay those of the unfused model (fp32, rtol 1e-5)."""
import pytest
import torch
from torch import fx

from picofx.capture.vocabulary import viewed_source
from picofx.models import real_models, zoo
from picofx.passes.fuse.fuse import Fuse
from picofx.testing import assert_trains_like_eager

aten = torch.ops.aten
CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}
MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.linear.default}
MODELS = {"llama-tiny": lambda: zoo.build("llama-tiny"), "hf-llama": lambda: real_models.build("hf-llama"),
          "hf-qwen2": lambda: real_models.build("hf-qwen2"), "gpt2-tiny": lambda: zoo.build("gpt2-tiny")}
# GPT-2 writes its q/k/v as one projection (c_attn) split in three: the backward joins their
# gradients for it in each of its 2 layers, as the unfused model's does. The rules add none.
MODELS_OWN_JOINS = {"gpt2-tiny": 2}
ROUNDING = (1e-5, 1e-5)  # the fused loss sums its chunks in another order (see the loss rule)


def source(node) -> fx.Node:
    """What `node` views or casts, through chains of both."""
    node = viewed_source(node, through_copies=True)
    while isinstance(node, fx.Node) and node.target in CASTS:
        node = viewed_source(node.args[0], through_copies=True)
    return node


def copied_weights(forward: fx.GraphModule) -> list[str]:
    """Concatenations in the forward graph that read the graph's inputs (its parameters): copies made every step."""
    return [n.name for n in forward.graph.nodes if n.target is aten.cat.default
            and any(source(t).op == "placeholder" for t in n.args[0])]


def concatenated_gradients(backward: fx.GraphModule) -> list[str]:
    """Concatenations in the backward graph whose result a matmul reads: gradients joined for a merged projection."""
    def feeds_matmul(node: fx.Node, cat: fx.Node) -> bool:  # directly, or through views and casts of it
        return any(u.target in MATMULS or (source(u) is cat and feeds_matmul(u, cat)) for u in node.users)
    return [n.name for n in backward.graph.nodes if n.target is aten.cat.default and feeds_matmul(n, n)]


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(MODELS))
def test_projections_copy_no_weights_and_join_no_gradients(name, backend):
    model = MODELS[name]()
    opt = assert_trains_like_eager(model, [Fuse()], backend=backend, tolerance=ROUNDING)
    notes = opt.report.records[0].notes
    assert notes["swiglu"] == (0 if name == "gpt2-tiny" else 2)  # GPT-2's MLP has no gate to fuse
    graphs = opt.graphs
    assert copied_weights(graphs["forward"]) == [], graphs["forward"].code
    joins = concatenated_gradients(graphs["backward"])
    assert len(joins) == MODELS_OWN_JOINS.get(name, 0), (joins, graphs["backward"].code)


def test_the_checks_see_a_merged_projection():
    """The two checks above find today's merge when a graph has it: cat of the weights, and the
    backward's cat of the gradients into the merged matmul."""
    class Merged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(16, 32, bias=False)

        def forward(self, x):
            gate, up = torch.nn.functional.linear(x, torch.cat([self.gate.weight, self.up.weight])).chunk(2, -1)
            return (torch.ops.picofx.silu_mul(gate, up) ** 2).mean()

    model = zoo.ZooModel(Merged(), {"x": torch.randn(2, 8, 16)}, None)
    opt = assert_trains_like_eager(model, [], backend="eager")
    assert len(copied_weights(opt.graphs["forward"])) == 1
    assert len(concatenated_gradients(opt.graphs["backward"])) == 1
