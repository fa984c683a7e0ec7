"""Find a rule's pattern in a graph and check each candidate.

1. Structure: torch.fx's SubgraphMatcher finds the pattern's nodes in the graph with constants
   ignored (the shapes in view/slice/expand arguments are the traced example's, not the model's).
2. Checks, in order; the first that rejects names the near-miss:
   "inputs"       tensor inputs are tensors, scalar inputs are Python constants of the right kind;
   "same_math"    the pattern traced again on the candidate's own inputs (shapes, dtypes, the matched
                  scalars; the variant's layout) has every constant the candidate has (dims compared
                  modulo rank);
   the rule's checks;
   "replacement"  the replacement, traced on the same inputs, returns what the candidate returns
                  (shapes, dtypes), and drops no output that the graph still uses.
Accepted candidates that do not overlap are replaced by picofx.rewrite.rewriter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from picofx.capture.annotate import common_module_path
from picofx.capture.vocabulary import layer_of
from picofx.rewrite.tracing import Traced, argument_names, call_nodes, normalized_args, trace_all
from picofx.rewrite.rules import Pattern, Rule, ScalarSpec, TensorSpec, pattern_graphs, trace_patterns


@dataclass
class Match:
    """One place where a rule's pattern occurs in the graph."""

    rule: Rule
    pattern: Pattern
    bindings: dict[str, Any]          # input name -> graph node (tensor inputs) or constant (scalar inputs)
    nodes: dict[fx.Node, fx.Node]     # pattern node -> graph node, placeholders excluded
    outputs: list[fx.Node]            # graph nodes that compute the pattern's outputs, in its order
    replacement: Traced | None = field(default=None, repr=False)

    def val(self, name: str):
        """A tensor input's fake value (shape, dtype, device), or a scalar input's constant."""
        value = self.bindings[name]
        return value.meta.get("val") if isinstance(value, fx.Node) else value

    @property
    def covered(self) -> set[fx.Node]:
        return set(self.nodes.values())

    def describe(self) -> str:
        path = common_module_path(self.covered)
        return ", ".join(n.name for n in self.outputs) + (f" in {path}" if path else "")


@dataclass(frozen=True)
class NearMiss:
    rule: str
    candidate: str
    check: str
    reason: str


class _StructureMatcher(SubgraphMatcher):
    """Constants match any constant (same_math compares them later), but only constants: a pattern
    node never matches a graph constant (SubgraphMatcher's ignore_literals would let it)."""

    def _match_literals(self, pn, gn, match) -> bool:
        if isinstance(pn, fx.Node) or isinstance(gn, fx.Node):
            return super()._match_literals(pn, gn, match)  # a placeholder takes the constant; else no match
        return True


@dataclass
class _Region:
    """The graph as the matcher sees it when looking for its pattern's outputs: these nodes."""

    nodes: list[fx.Node]


def anchor_regions(graph: fx.Graph, anchors: list[fx.Node]) -> list:
    """Where to look for a pattern's outputs. A pattern of several outputs (q and k of RoPE, the
    Q/K/V projections) pairs candidates for each output with every other's: over the whole graph
    that is quadratic in the layers, so its outputs are sought together within one decoder layer
    at a time (the graph's nodes of the outputs' ops, by fx's index of nodes by target)."""
    if len(anchors) == 1:
        return [graph]
    nodes = sorted({n for target in {a.target for a in anchors}
                    for n in graph.find_nodes(op=anchors[0].op, target=target, sort=False)})
    regions: dict[str, list[fx.Node]] = {}
    for node in nodes:
        regions.setdefault(layer_of(node) or "", []).append(node)
    return [_Region(region) for region in regions.values()]


def find_candidates(graph: fx.Graph, rule: Rule, pattern: Pattern) -> list[Match]:
    if not all(graph.find_nodes(op="call_function", target=target, sort=False)
               for target in {n.target for n in call_nodes(pattern.graph)}):
        return []  # an op of the pattern is nowhere in the graph (the graph indexes its nodes by target)
    matcher = _StructureMatcher(pattern.graph, remove_overlapping_matches=False)
    returned = pytree.tree_leaves(pattern.graph.output_node().args[0])
    candidates = []
    for found in (m for region in anchor_regions(graph, matcher.pattern_anchors) for m in matcher.match(region)):
        bindings = {pattern.inputs[p]: g for p, g in found.nodes_map.items() if p.op == "placeholder"}
        nodes = {p: g for p, g in found.nodes_map.items() if p.op == "call_function"}
        candidates.append(Match(rule, pattern, bindings, nodes, [found.nodes_map[p] for p in returned]))
    return candidates


# ---- checks every rule gets -----------------------------------------------------------------

def inputs(match: Match) -> str | None:
    spec, _ = match.rule.variant_inputs(match.pattern.variant)
    for name, kind in spec.items():
        value = match.bindings.get(name)
        if isinstance(kind, TensorSpec) and not (isinstance(value, fx.Node)
                                                 and isinstance(value.meta.get("val"), torch.Tensor)):
            return f"{name} is the constant {value!r}, not a tensor"
        if isinstance(kind, ScalarSpec):
            if isinstance(value, fx.Node):
                return f"{name} is computed by node {value.name} (a tensor); the pattern takes a Python constant"
            if not kind.accepts(value):
                return f"{name} is {value!r} ({type(value).__name__}); the pattern takes {kind.example!r}-like values"
    return None


def same_math(match: Match) -> str | None:
    retraced = traced_for(match, match.rule.pattern)
    if isinstance(retraced, Exception):
        return f"the pattern does not trace on these inputs: {type(retraced).__name__}: {retraced}"
    pattern_nodes, retraced_nodes = call_nodes(match.pattern.graph), call_nodes(retraced.graph)
    if [n.target for n in retraced_nodes] != [n.target for n in pattern_nodes]:
        return "the pattern traces to other ops for these inputs' dtypes and shapes"
    expected_of = {p: match.bindings[name] for p, name in retraced.inputs.items()}
    expected_of.update((r, match.nodes[p]) for r, p in zip(retraced_nodes, pattern_nodes))
    for p, r in zip(pattern_nodes, retraced_nodes):
        node = match.nodes[p]
        expected = fx.node.map_arg(normalized_args(r), lambda n: expected_of[n])
        for name, want, have in zip(argument_names(node), expected, normalized_args(node)):
            if not _same_value(want, have, _rank(node) if name in ("dim", "dims") else None):
                return (f"{node.name} = {node.target}(..., {name}={_show(have)}) "
                        f"where the pattern has {name}={_show(want)}")
    return None


def replacement(match: Match) -> str | None:
    traced = traced_for(match, match.rule.replacement, for_replacement=True)
    if isinstance(traced, Exception):
        return f"the replacement does not trace on these inputs: {type(traced).__name__}: {traced}"
    new_outputs = traced.outputs()
    if len(new_outputs) != len(match.outputs):
        return f"the replacement returns {len(new_outputs)} values where the pattern returns {len(match.outputs)}"
    for i, (new, old) in enumerate(zip(new_outputs, match.outputs)):
        if new is None:
            users = [u.name for u in old.users if u not in match.covered and u.op != "output"]
            if users:
                return f"the replacement drops {old.name} (output {i}), which {users[0]} still uses"
            continue
        have, want = new.meta["val"], old.meta["val"]
        if tuple(have.shape) != tuple(want.shape) or have.dtype != want.dtype:
            return (f"the replacement's output {i} is {tuple(have.shape)} {have.dtype}, "
                    f"{old.name} is {tuple(want.shape)} {want.dtype}")
    match.replacement = traced
    return None


def _rank(node: fx.Node) -> int | None:
    first = next((a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)), None)
    return first.meta["val"].dim() if first is not None else None


def _same_value(want, have, rank: int | None) -> bool:
    if isinstance(want, (list, tuple)) and isinstance(have, (list, tuple)):
        return len(want) == len(have) and all(_same_value(w, h, rank) for w, h in zip(want, have))
    if isinstance(want, fx.Node) or isinstance(have, fx.Node):
        return want is have
    if rank and isinstance(want, int) and isinstance(have, int):
        return want % rank == have % rank
    numbers = (int, float)
    if isinstance(want, numbers) and isinstance(have, numbers):
        return isinstance(want, bool) == isinstance(have, bool) and want == have
    return type(want) is type(have) and want == have


def _show(value) -> str:
    return value.name if isinstance(value, fx.Node) else repr(value)


# ---- tracing on a candidate's inputs ------------------------------------------------------------

def _input_key(value, kind, own_layout: bool) -> tuple:
    if not isinstance(kind, (TensorSpec, ScalarSpec)):
        return ("fixed",)
    if not isinstance(value, fx.Node):
        return ("constant", type(value), value)
    val = value.meta["val"]
    stride = tuple(val.stride()) if own_layout else _strides(tuple(val.shape), kind.stored_as)
    return ("tensor", tuple(val.shape), stride, val.dtype, val.device)


def _strides(shape: tuple, stored_as: tuple | None) -> tuple:
    """The strides of a dense tensor of `shape` whose dims are laid out in `stored_as` order."""
    order = stored_as or tuple(range(len(shape)))
    strides, step = [0] * len(shape), 1
    for dim in reversed(order):
        strides[dim], step = step, step * max(shape[dim], 1)
    return tuple(strides)


def _trace_key(match: Match, fn, for_replacement: bool) -> tuple:
    """(rule, key in the rule's traces). The pattern is traced again in the layout its variant was
    traced in (the match already proved the structure; the trace is for the constants), the
    replacement in the inputs' own layout (its outputs' strides must be the real ones)."""
    spec, _ = match.rule.variant_inputs(match.pattern.variant)
    inputs = tuple((name, _input_key(match.bindings.get(name), kind, for_replacement)) for name, kind in spec.items())
    options = tuple(match.rule.options.items()) if for_replacement else ()
    return match.rule, (match.pattern.variant, fn, inputs, options)


def traced_for(match: Match, fn, for_replacement: bool = False) -> Traced | Exception:
    """`fn` traced on the candidate's inputs: fake tensors like the bound nodes', the matched scalars
    (an exception when it does not trace)."""
    rule, key = _trace_key(match, fn, for_replacement)
    traced = rule.traces.get(key)
    if traced is None:
        trace_keys([(rule, key)])
        traced = rule.traces.get(key)
    return traced


def trace_keys(keys: list[tuple]) -> None:
    """Trace every (rule, key) not in its rule's traces yet, all in one export."""
    missing = {(rule.traces, key): rule for rule, key in keys if rule.traces.get(key) is None}  # copies share
    keys = [(rule, key) for (_, key), rule in missing.items()]
    if not keys:
        return
    mode = FakeTensorMode()
    calls = []
    for rule, (variant, fn, inputs, options) in keys:
        spec, _ = rule.variant_inputs(variant)
        kwargs = {}
        for name, key in inputs:
            if key[0] == "tensor":
                _, shape, stride, dtype, device = key
                with mode:
                    kwargs[name] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            else:
                kwargs[name] = key[2] if key[0] == "constant" else spec[name]
        calls.append((fn, {**kwargs, **dict(options)}))
    for (rule, key), traced in zip(keys, trace_all(calls)):
        rule.traces.put(key, traced)


# ---- finding ---------------------------------------------------------------------------------

GENERIC_CHECKS = (inputs, same_math)


def check(match: Match) -> tuple[str, str] | None:
    """(check name, reason) of the first check that rejects the match, or None."""
    for check_fn in (*GENERIC_CHECKS, *match.rule.checks, replacement):
        reason = check_fn(match)
        if reason is not None:
            return check_fn.__name__, reason
    return None


def candidate_trace_keys(candidates: list[Match]) -> list[tuple]:
    """What checking these candidates traces: the pattern and the replacement on each one's inputs."""
    return [_trace_key(c, fn, fn is c.rule.replacement) for c in candidates if inputs(c) is None
            for fn in (c.rule.pattern, c.rule.replacement)]


def prepare(graph: fx.Graph, rules: list[Rule], store=None) -> None:
    """Trace ahead, in two exports, what applying `rules` to `graph` will need: every rule's
    patterns, then the traces for the candidates each rule checks first in the graph as it is now
    (a rule whose pattern contains another rule's fused op traces its own later). `store` as
    trace_patterns."""
    trace_patterns(rules, store)
    trace_keys([key for rule in rules for key in candidate_trace_keys(first_per_site(rule_candidates(graph, rule)))])


def rule_candidates(graph: fx.Graph, rule: Rule) -> list[Match]:
    """Every pattern's candidates, in the order they are checked."""
    return [c for pattern in pattern_graphs(rule) for c in find_candidates(graph, rule, pattern)]


def first_per_site(candidates: list[Match]) -> list[Match]:
    """The first candidate for each set of covered nodes: several variants of a rule often match
    one site, and once one is accepted the others are never checked, nor traced."""
    firsts: dict[frozenset, Match] = {}
    for candidate in candidates:
        firsts.setdefault(frozenset(candidate.covered), candidate)
    return list(firsts.values())


def find_matches(graph: fx.Graph, rule: Rule) -> tuple[list[Match], list[NearMiss]]:
    """The accepted, non-overlapping matches of `rule` in graph order, and the rejected candidates.
    Each site's candidates are checked in order until one is accepted; they are traced in rounds
    (each site's next candidate, all in one export), so a site never traces a candidate after the
    one it accepts."""
    accepted: dict[frozenset, Match] = {}
    rejected: dict[frozenset, NearMiss] = {}
    candidates = rule_candidates(graph, rule)
    first_seen = {}
    for i, candidate in enumerate(candidates):
        first_seen.setdefault(frozenset(candidate.covered), i)
    pending = candidates
    while pending:
        round_ = first_per_site(pending)
        trace_keys(candidate_trace_keys(round_))
        for candidate in round_:
            key = frozenset(candidate.covered)
            verdict = check(candidate)
            if verdict is None:
                accepted[key] = candidate
            elif key not in rejected:
                rejected[key] = NearMiss(rule.name, candidate.describe(), *verdict)
        checked = {id(c) for c in round_}
        pending = [c for c in pending if id(c) not in checked and frozenset(c.covered) not in accepted]
    for key in accepted:
        rejected.pop(key, None)
    rejected = dict(sorted(rejected.items(), key=lambda kv: first_seen[kv[0]]))
    order = {n: i for i, n in enumerate(graph.nodes)}
    chosen, taken = [], set()
    for match in sorted(accepted.values(), key=lambda m: min(order[n] for n in m.covered)):
        if not match.covered & taken:
            chosen.append(match)
            taken |= match.covered
    return chosen, list(rejected.values())
