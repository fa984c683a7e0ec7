"""Replace matches of a rule with its replacement, inlined, and keep the graph's layouts valid.

A fused op may return another memory layout than the ops it replaces (the rope op returns
contiguous q and k where the model's were permuted views). Nothing changes for the values, but
a later `view` captured for the old strides may no longer apply: `refresh_values` propagates
fake values again from the replaced nodes on and puts a contiguous copy before such a view, which
is what `reshape` does.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import fx

from picofx.capture.annotate import common_module_path, fake_mode_of
from picofx.rewrite.matcher import Match, NearMiss, find_matches
from picofx.rewrite.rules import Rule
from picofx.capture.vocabulary import module_path


def cycle_reason(match: Match, bindings: dict | None = None) -> str | None:
    """Why inlining the match's replacement would make a cycle, or None: one of its inputs is
    computed from a node the match covers (e.g. k of one layer's RoPE from the q another layer's
    RoPE rotates), so the fused op would need its own output. The graph must be in topological
    order: the search walks back from each input and stops at nodes before the match's first."""
    covered = match.covered
    first = min(covered)  # fx nodes compare by their position in the graph
    for name, value in (bindings if bindings is not None else match.bindings).items():
        if not isinstance(value, fx.Node) or value < first:
            continue
        stack, seen = [value], {value}
        while stack:
            node = stack.pop()
            if node in covered:
                return (f"input {name} ({value.name}) is computed from {node.name}, which the match replaces: "
                        "the fused op would depend on its own output (a cycle)")
            for source in node.all_input_nodes:
                if source not in seen and not source < first:
                    seen.add(source)
                    stack.append(source)
    return None


def replace(graph: fx.Graph, match: Match, bindings: dict, replaced: dict[fx.Node, fx.Node | None]) -> list[str]:
    """Inline the match's replacement in place of its nodes, the graph staying in topological order;
    `bindings` are the match's inputs as the graph has them now, `replaced` maps every graph node a
    replacement removed to its new node (a later match may take it as an input).
    Returns the names of outputs the replacement dropped (graph outputs now None)."""
    traced = match.replacement
    covered = sorted(match.covered)
    inputs = [v for v in bindings.values() if isinstance(v, fx.Node)]
    point = max([covered[0], *(node.next for node in inputs)])  # after the last input (a late table)
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
    if point is not covered[0]:
        _move_users_after(covered[0], point, {*inlined, *(env[new] for new in traced.outputs() if new is not None)})
    for node in [*reversed(covered), *reversed(inlined)]:  # what nothing uses any more (e.g. unused logits)
        if not node.users:
            graph.erase_node(node)
    return dropped


def _move_users_after(start: fx.Node, point: fx.Node, new_values: set[fx.Node]) -> None:
    """The replacement went in late, just before `point`: the nodes from `start` on that use its values
    (directly or through each other) move after it, in their order. Nothing the replacement reads
    is among them: cycle_reason rejected such matches."""
    late, moving = set(new_values), []
    node = start
    while node is not point:
        if node not in late and any(source in late for source in node.all_input_nodes):
            late.add(node)
            moving.append(node)
        node = node.next
    for node in moving:
        point.prepend(node)


def _current(value, replaced: dict):
    while isinstance(value, fx.Node) and value in replaced:
        value = replaced[value]
    return value


def rewrite(gm: fx.GraphModule, rule: Rule) -> tuple[list[Match], list[NearMiss], list[str]]:
    """Apply `rule` everywhere it matches: (applied matches, near-misses, dropped output names). A
    match that would make a cycle (an earlier replacement may have joined its inputs to its
    outputs) is skipped, and reported with the near-misses as check "acyclic"."""
    matches, near_misses = find_matches(gm.graph, rule)
    replaced: dict[fx.Node, fx.Node | None] = {}
    applied, dropped = [], []
    for match in matches:
        bindings = {name: _current(value, replaced) for name, value in match.bindings.items()}
        reason = cycle_reason(match, bindings)
        if reason is not None:
            near_misses.append(NearMiss(rule.name, match.describe(), "acyclic", reason))
            continue
        dropped += replace(gm.graph, match, bindings, replaced)
        applied.append(match)
    if applied:
        refresh_values(gm)
    return applied, near_misses, dropped


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
            copy.meta = {"module_path": module_path(node)}
            node.replace_input_with(source, copy)
            self.env[copy] = copy.meta["val"] = self.env[source].clone(memory_format=torch.contiguous_format)
            value = super().run_node(node)
        if node.op not in ("placeholder", "output"):
            node.meta["val"] = value
        return value


def refresh_values(gm: fx.GraphModule) -> None:
    """Propagate fake values from the nodes replacements inlined (their values came with them; they
    have no meta["flops"] yet, which annotation gives every other node) to the nodes downstream,
    stopping where a value keeps its shape, strides and dtype: a rewrite costs its neighbourhood,
    not the whole graph. A graph never annotated is propagated whole from its placeholders."""
    mode = fake_mode_of(gm)
    fixer = _ViewFixer(gm)
    nodes = list(gm.graph.nodes)
    if not any("flops" in n.meta for n in nodes):
        with mode:
            fixer.run(*[_in_mode(mode, n.meta["val"]) for n in nodes if n.op == "placeholder"])
        return
    stale: set[fx.Node] = set()  # nodes whose users may hold values computed from an older value
    with mode:
        for node in nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            if "flops" not in node.meta:
                stale.add(node)
                continue
            if not any(source in stale for source in node.all_input_nodes):
                continue
            for source in node.all_input_nodes:
                if source not in fixer.env:
                    fixer.env[source] = _in_mode(mode, source.meta["val"])
            old = node.meta.get("val")
            fixer.env[node] = fixer.run_node(node)
            if _layout(old) != _layout(fixer.env[node]):
                stale.add(node)


def _in_mode(mode, value):
    """`value` as fake tensors of `mode` (a replacement's values were traced in a mode of their own)."""
    def convert(t):
        if isinstance(t, torch._subclasses.FakeTensor) and t.fake_mode is mode:
            return t
        if isinstance(t, torch._subclasses.FakeTensor):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return mode.from_tensor(t) if isinstance(t, torch.Tensor) else t

    return pytree.tree_map(convert, value)


def _layout(value) -> list:
    return [(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype) if isinstance(t, torch.Tensor) else t
            for t in pytree.tree_leaves(value)]
