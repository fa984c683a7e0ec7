"""The rewriter never makes a cycle: a match one of whose inputs is computed from an output of the
nodes it replaces is skipped, and the fuse report says why (check "acyclic"); the graph stays
acyclic, in topological order, and computes what it did.

The rule here pairs two independent ops, tanh(a) and sigmoid(b), into one node that reads both
(the way RoPE pairs q and k): wherever b is computed from tanh(a), fusing them would need the
fused op's own output."""
import torch
from torch import fx, nn

from picofx.models.zoo import ZooModel
from picofx.passes.fuse.fuse import Fuse
from picofx.rewrite.rewriter import cycle_reason
from picofx.rules import Rule, tensor
from picofx.testing import captured, count_ops, run_pass

aten = torch.ops.aten


def pair_pattern(a, b):
    return torch.tanh(a), torch.sigmoid(b)


def pair_replacement(a, b):
    both = torch.stack((a, b))  # (captured as cat): the one node both outputs come from, as a fused op's
    return torch.tanh(both[0]), torch.sigmoid(both[1])


PAIR = Rule(name="tanh_sigmoid_pair", pattern=pair_pattern, replacement=pair_replacement,
            inputs={"a": tensor(4, 8), "b": tensor(4, 8)})
# The same rule, but candidates that would make a cycle are rejected while matching (as the RoPE
# rules do), so that the rewriter meets only what an earlier replacement made cyclic.
PAIR_CHECKED = Rule(name="tanh_sigmoid_pair", pattern=pair_pattern, replacement=pair_replacement,
                    inputs={"a": tensor(4, 8), "b": tensor(4, 8)}, checks=(cycle_reason,))


class Chained(nn.Module):
    """sigmoid's input is computed from tanh's output: the pair cannot become one node."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        first = torch.tanh(self.proj(x))
        return torch.sigmoid(first * 2.0) + first


class Independent(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return torch.tanh(h) * torch.sigmoid(h + 1.0)


class Crossed(nn.Module):
    """Two pairs, each acyclic alone: (tanh(x), sigmoid(y)) and (tanh(z), sigmoid(w)). But y is
    computed from tanh(z) and w from tanh(x): once the first pair is one node, which reads y, w
    depends on it, and so on tanh(z) of the second pair."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, inp):
        x, z = self.proj(inp).chunk(2, dim=-1)
        a, c = torch.tanh(x), torch.tanh(z)
        b = torch.sigmoid(c * 3.0)
        d = torch.sigmoid(a * 2.0)
        return a + b + c + d


def fuse(module, rule):
    torch.manual_seed(0)
    gm, ctx = captured(ZooModel(module, {"inp" if isinstance(module, Crossed) else "x": torch.randn(4, 8)}, None))
    record = run_pass(Fuse(rules=(rule,), explain=True), gm, ctx)  # verify="numerics": outputs and gradients
    return gm, record


def assert_topologically_ordered(graph: fx.Graph):
    seen = set()
    for node in graph.nodes:
        assert all(source in seen for source in node.all_input_nodes), f"{node.name} comes before an input"
        seen.add(node)
    graph.lint()


def acyclic_misses(record):
    return [m for m in record.notes["near_misses"] if m["check"] == "acyclic"]


def test_a_match_whose_input_comes_from_its_output_is_skipped():
    gm, record = fuse(Chained(), PAIR)
    assert record.notes["tanh_sigmoid_pair"] == 0
    assert count_ops(gm, aten.cat.default) == 0
    assert count_ops(gm, aten.tanh.default) == 1 and count_ops(gm, aten.sigmoid.default) == 1
    (miss,) = acyclic_misses(record)
    assert miss["rule"] == "tanh_sigmoid_pair"
    assert miss["reason"].startswith("input b (mul) is computed from tanh") and "cycle" in miss["reason"]
    assert_topologically_ordered(gm.graph)


def test_the_rule_fuses_where_its_inputs_are_independent():
    gm, record = fuse(Independent(), PAIR)
    assert record.notes["tanh_sigmoid_pair"] == 1 and not record.notes["near_misses"]
    assert count_ops(gm, aten.cat.default) == 1
    assert_topologically_ordered(gm.graph)


def test_a_match_an_earlier_replacement_made_cyclic_is_skipped():
    gm, record = fuse(Crossed(), PAIR_CHECKED)
    assert record.notes["tanh_sigmoid_pair"] == 1 and count_ops(gm, aten.cat.default) == 1
    (miss,) = acyclic_misses(record)
    assert "is computed from tanh_1" in miss["reason"] and "cycle" in miss["reason"], miss
    assert_topologically_ordered(gm.graph)


def test_a_late_input_moves_the_users_of_the_replacement_after_it():
    """(tanh(x), sigmoid(y)) with y computed after tanh(x) is used: the fused node goes after y, and
    the use of tanh(x) in between moves after it, in order (no sort of the whole graph)."""

    class LateInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 16)

        def forward(self, x):
            h, g = self.proj(x).chunk(2, dim=-1)
            a = torch.tanh(h)
            used_early = a * 2.0
            late = g.exp()
            return used_early + torch.sigmoid(late)

    gm, record = fuse(LateInput(), PAIR)
    assert record.notes["tanh_sigmoid_pair"] == 1 and not acyclic_misses(record)
    assert_topologically_ordered(gm.graph)
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert order.index(aten.exp.default) < order.index(aten.cat.default) < order.index(aten.mul.Tensor)
