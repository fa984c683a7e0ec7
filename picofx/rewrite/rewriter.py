"""Replace matches of a rule with its replacement, inlined, and keep the graph's layouts valid.

A fused op may return another memory layout than the ops it replaces (the rope op returns
contiguous q and k where the model's were permuted views). Nothing changes for the values, but
a later `view` captured for the old strides may no longer apply: `refresh_values` propagates
fake values again and puts a contiguous copy before such a view, which is what `reshape` does.
"""
from __future__ import annotations

import torch
from torch import fx
from torch.fx.passes.tools_common import stable_topological_sort

from picofx.capture.annotate import common_module_path, fake_mode_of
from picofx.rewrite.matcher import Match, NearMiss, find_matches
from picofx.rewrite.rules import Rule


def replace(graph: fx.Graph, match: Match, replaced: dict[fx.Node, fx.Node | None]) -> tuple[list[str], bool]:
    """Inline the match's replacement in place of its nodes; `replaced` maps every graph node an
    earlier replacement removed to its new node (a later match may take it as an input).
    Returns the names of outputs the replacement dropped (graph outputs now None), and whether
    the graph needs a topological sort (the replacement went after an input that came late)."""
    bindings = {name: _current(value, replaced) for name, value in match.bindings.items()}
    traced = match.replacement
    order = {n: i for i, n in enumerate(graph.nodes)}
    covered = sorted(match.covered, key=order.__getitem__)
    inputs = [v for v in bindings.values() if isinstance(v, fx.Node)]
    point = covered[0]
    last_input = max(inputs, key=order.__getitem__, default=None)
    reorder = last_input is not None and order[last_input] > order[point]
    if reorder:
        point = last_input.next
    module_path = common_module_path(covered)
    env = {p: bindings[name] for p, name in traced.inputs.items()}
    inlined = []
    with graph.inserting_before(point):
        for node in traced.graph.nodes:
            if node.op == "call_function":
                env[node] = graph.node_copy(node, lambda a: env[a])
                env[node].meta = {"val": node.meta.get("val"), "module_path": module_path}
                inlined.append(env[node])
    dropped = []
    for old, new in zip(match.outputs, traced.outputs()):
        if new is None:
            output = graph.output_node()
            if old in output.all_input_nodes:
                output.args = fx.node.map_arg(output.args, lambda n: None if n is old else n)
                dropped.append(old.name)
        else:
            old.replace_all_uses_with(env[new])
        replaced[old] = env[new] if new is not None else None
    for node in [*reversed(covered), *reversed(inlined)]:  # what nothing uses any more (e.g. unused logits)
        if not node.users:
            graph.erase_node(node)
    return dropped, reorder


def _current(value, replaced: dict):
    while isinstance(value, fx.Node) and value in replaced:
        value = replaced[value]
    return value


def rewrite(gm: fx.GraphModule, rule: Rule) -> tuple[list[Match], list[NearMiss], list[str]]:
    """Apply `rule` everywhere it matches: (applied matches, near-misses, dropped output names)."""
    matches, near_misses = find_matches(gm.graph, rule)
    replaced: dict[fx.Node, fx.Node | None] = {}
    dropped, reorder = [], False
    for match in matches:
        names, needs_sort = replace(gm.graph, match, replaced)
        dropped += names
        reorder |= needs_sort
    if reorder:  # once, at the end: the sort copies every node, which the other matches still name
        stable_topological_sort(gm)
    if matches:
        refresh_values(gm)
    return matches, near_misses, dropped


class _ViewFixer(fx.Interpreter):
    """Propagates fake values, storing them in meta["val"]; a view that its input's strides do not
    allow gets a contiguous clone of its input first."""

    def run_node(self, node: fx.Node):
        try:
            value = super().run_node(node)
        except (RuntimeError, ValueError):
            if node.target is not torch.ops.aten.view.default:
                raise
            source = node.args[0]
            with self.graph.inserting_before(node):
                copy = self.graph.call_function(torch.ops.aten.clone.default, (source,),
                                                {"memory_format": torch.contiguous_format})
            copy.meta = {"module_path": node.meta.get("module_path", "")}
            node.replace_input_with(source, copy)
            self.env[copy] = copy.meta["val"] = self.env[source].clone(memory_format=torch.contiguous_format)
            value = super().run_node(node)
        if node.op not in ("placeholder", "output"):
            node.meta["val"] = value
        return value


def refresh_values(gm: fx.GraphModule) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mode = fake_mode_of(gm)
    with mode:
        inputs = [mode.from_tensor(n.meta["val"]) if not isinstance(n.meta["val"], torch._subclasses.FakeTensor)
                  else n.meta["val"] for n in placeholders]
        _ViewFixer(gm).run(*inputs)
