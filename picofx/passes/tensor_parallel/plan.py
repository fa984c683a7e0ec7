"""The Megatron tensor-parallel plan, inferred from a captured forward graph instead of module names.

A linear's output features can be split across `tp` ranks (column-parallel) when everything that
follows it up to the next linear works on each rank's features alone: pointwise ops (with operands
that do not vary over those features, or that are split the same way), views that split the
features into (heads, head_dim) with the heads divisible by `tp` or merge them back, permutes,
GQA's repeat of key/value heads, slices and reductions over other dimensions, attention over
heads. The linear that then reads the split features is row-parallel (its input features split,
its output a partial sum, all-reduced). Everything the walk cannot follow leaves the linear whole,
with the reason. The embedding table is vocabulary-parallel (rows split, the lookup masked, the
partial results summed); a linear whose output reaches the loss without another linear, or the
weight of a loss fuse_loss fused with its projection, is the LM head, column-parallel with a
vocabulary-parallel cross-entropy; tied embedding and head share one row split; a vocabulary tp
does not divide is padded to a multiple of it, as Megatron does. Norm weights and anything else
are replicated.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from picofx.capture.vocabulary import USER, input_kind, input_slot, is_parameter, layer_of, viewed_source
from picofx.passes.tensor_parallel.loss import LINEAR_CROSS_ENTROPY

aten = torch.ops.aten
LINEARS = {aten.linear.default}
ATTENTION = {aten.scaled_dot_product_attention.default}
LOSSES = {aten._log_softmax.default, aten.log_softmax.int, aten.cross_entropy_loss.default,
          aten.nll_loss_forward.default}
POINTWISE_PACKETS = {aten.mul, aten.add, aten.sub, aten.div, aten.neg, aten.sigmoid, aten.silu, aten.gelu, aten.relu,
                     aten.tanh, aten.pow, aten.exp, aten.where, aten._to_copy, aten.clone, aten.contiguous,
                     aten.alias, aten.dropout, aten.native_dropout, aten.mish, aten.erf, aten.rsqrt, aten.sqrt,
                     aten.reciprocal, aten.abs, aten.sin, aten.cos, aten.clamp, aten.square, aten.log, aten.gelu,
                     aten.softplus, aten.type_as, aten.masked_fill}
SAME_DIMS_PACKETS = {aten.clone, aten.contiguous, aten.alias, aten._to_copy}


class NotSplittable(Exception):
    pass


@dataclass
class ParameterPlan:
    style: str  # "colwise", "rowwise", "vocab", "replicate"
    why: str


@dataclass
class TensorParallelPlan:
    tp: int
    parameters: dict[str, ParameterPlan] = field(default_factory=dict)
    kv_replicated: list[str] = field(default_factory=list)  # k/v projections left whole: their heads do not divide

    def style(self, name: str) -> str:
        return self.parameters[name].style if name in self.parameters else "replicate"

    def table(self) -> str:
        width = max((len(n) for n in self.parameters), default=10)
        return "\n".join(f"{name.ljust(width)}  {p.style:9s}  {p.why}" for name, p in self.parameters.items())


def weight_name(node: fx.Node, position: int) -> str | None:
    """The parameter a node's argument `position` reads (through views and casts), or None."""
    if len(node.args) <= position or not isinstance(node.args[position], fx.Node):
        return None
    source = viewed_source(node.args[position], through_copies=True)
    while source.op == "call_function" and source.target is aten._to_copy.default:
        source = viewed_source(source.args[0], through_copies=True)
    return input_slot(source).target if is_parameter(source) else None


def split_dim_after(node: fx.Node, source: fx.Node, dim: int, tp: int, linear: fx.Node) -> int | None:
    """Where the split dimension `dim` of `source` (on the path from `linear`) lands in `node`'s
    output; raises NotSplittable when `node` mixes the split features."""
    if node.target is operator.getitem:  # a piece of a split along another dimension
        return dim
    val, shape = node.meta.get("val"), tuple(source.meta["val"].shape)
    target, packet = node.target, getattr(node.target, "overloadpacket", None)
    if target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return reshaped_dim(shape, tuple(val.shape), dim, tp)
    if target is aten.permute.default:
        return list(node.args[1]).index(dim % len(shape))
    if target in (aten.transpose.int,):
        a, b = (d % len(shape) for d in node.args[1:3])
        return b if dim == a else a if dim == b else dim
    if target is aten.unsqueeze.default:
        at = node.args[1] % (len(shape) + 1)
        return dim + 1 if at <= dim else dim
    if target is aten.expand.default:
        return dim if shape[dim] == val.shape[dim] else _fail(node, "broadcasts the split dimension")
    if target in (aten.slice.Tensor, aten.split_with_sizes.default, aten.split.Tensor):
        axis = (node.args[1] if len(node.args) > 1 else 0) if target is aten.slice.Tensor else \
            (node.args[2] if len(node.args) > 2 else 0)
        return dim if axis % len(shape) != dim else _fail(node, "slices the split dimension")
    if target is aten.cat.default:
        axis = node.args[1] if len(node.args) > 1 else 0
        return dim if axis % len(shape) != dim else _fail(node, "concatenates along the split dimension")
    if target is aten.view_as_complex.default:  # (..., d/2, 2) -> complex (..., d/2)
        return dim if dim < len(shape) - 1 else _fail(node, "pairs the split features as complex numbers")
    if target is aten.view_as_real.default:
        return dim
    if target in ATTENTION:
        return dim if dim == 1 else _fail(node, "attends across the split dimension")
    if packet in POINTWISE_PACKETS:
        out = dim + (val.dim() - len(shape))  # broadcasting prepends dimensions
        for other in node.all_input_nodes:
            size = _aligned_size(other, val.dim(), out)
            if other is not source and size not in (1, None) and not from_sibling(other, linear):
                _fail(node, "mixes the split features with whole ones")
        return out
    if packet in (aten.mean, aten.sum, aten.amax, aten._softmax, aten.softmax):
        dims = node.args[1] if len(node.args) > 1 else None
        dims = [dims] if isinstance(dims, int) else dims
        if dims is None or dim in [d % len(shape) for d in dims]:
            _fail(node, "reduces over the split features")
        return dim
    _fail(node, f"{node.target} is not known to keep features apart")


def _aligned_size(node: fx.Node, ndim: int, dim: int) -> int | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    at = dim - (ndim - val.dim())
    return val.shape[at] if at >= 0 else 1


def from_sibling(node: fx.Node, linear: fx.Node, depth: int = 12) -> bool:
    """`node` comes, through pointwise ops and views, from a linear reading the same input as
    `linear` (SwiGLU's up projection beside its gate): split the same way."""
    frontier = [node]
    for _ in range(depth):
        found = [n for n in frontier if n.target in LINEARS]
        if any(n.args[0] is linear.args[0] for n in found):
            return True
        frontier = [a for n in frontier if n.target not in LINEARS and n.op == "call_function"
                    for a in n.all_input_nodes]
        if not frontier:
            return False
    return False


def reshaped_dim(old: tuple, new: tuple, dim: int, tp: int) -> int:
    """Where dimension `dim` of shape `old` goes in `new`: splitting it into (heads, rest) puts the
    split on heads (divisible by tp); merging it as the outer factor keeps it."""
    before = math.prod(old[:dim])
    size = old[dim]
    acc, i = 1, 0
    while i < len(new) and acc < before:
        acc *= new[i]
        i += 1
    if acc != before or i >= len(new):
        raise NotSplittable(f"a view {old} -> {new} moves the split dimension")
    if new[i] == size:
        return i
    if size % new[i] == 0 and new[i] % tp == 0:  # split into (heads, head_dim): heads carry the split
        return i
    if new[i] % size == 0 and (size % tp == 0):  # merged with later dimensions as the outer factor
        return i
    raise NotSplittable(f"a view {old} -> {new} splits {size} features into {new[i]} heads, "
                        f"which tp={tp} does not divide")


def _fail(node: fx.Node, why: str):
    raise NotSplittable(f"{node.name} ({layer_of(node) or 'top level'}): {why}")


def walk_column(linear: fx.Node, tp: int, split_dims: dict | None = None) -> set[fx.Node]:
    """The linears that read `linear`'s split output features (row-parallel); raises NotSplittable.
    `split_dims`, when given, is filled with each node on the way and its split dimension."""
    frontier, rows, seen = [(linear, linear.meta["val"].dim() - 1)], set(), set()
    while frontier:
        node, dim = frontier.pop()
        for user in node.users:
            if user.op == "output":
                raise NotSplittable(f"{node.name}'s split features are a graph output")
            if user.target in LINEARS and user.args[0] is node:
                if dim != node.meta["val"].dim() - 1:
                    _fail(user, "reads the split features in another layout")
                rows.add(user)
                continue
            if user.target in LOSSES:
                _fail(user, "computes the loss over the split features")
            if (user, dim) in seen:
                continue
            seen.add((user, dim))
            frontier.append((user, split_dim_after(user, node, dim, tp, linear)))
            if split_dims is not None:
                split_dims[user] = frontier[-1][1]
    return rows


def takes_token_ids(embedding: fx.Node) -> bool:
    """The lookup's indices are the step's input (token ids), not positions the model made."""
    indices = viewed_source(embedding.args[1], through_copies=True)
    return input_kind(indices) == USER


def reaches_loss(node: fx.Node) -> bool:
    frontier, seen = [node], set()
    while frontier:
        n = frontier.pop()
        for user in n.users:
            if user.target in LOSSES:
                return True
            if user.target in LINEARS or user in seen:
                continue
            seen.add(user)
            frontier.append(user)
    return False


def infer_plan(gm: fx.GraphModule, tp: int) -> TensorParallelPlan:
    """The plan for the captured forward graph `gm` (fuse not yet run, but fuse_loss: the loss and
    its projection may be one op) on `tp` ranks."""
    plan = TensorParallelPlan(tp)
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEARS and weight_name(n, 1)]
    fused_heads = [n for n in gm.graph.nodes if n.target is LINEAR_CROSS_ENTROPY and weight_name(n, 1)]
    for node in gm.graph.nodes:
        if node.target is aten.embedding.default and weight_name(node, 0) and takes_token_ids(node):
            rows = node.args[0].meta["val"].shape[0]
            padded = "" if rows % tp == 0 else f" (padded to {-(-rows // tp) * tp}, as Megatron pads)"
            plan.parameters[weight_name(node, 0)] = ParameterPlan(
                "vocab", f"embedding table: {rows} rows{padded} over {tp} ranks, lookup masked, partial rows summed")
    for linear in linears + fused_heads:
        name = weight_name(linear, 1)
        if linear.target is LINEAR_CROSS_ENTROPY or reaches_loss(linear):
            tied = plan.parameters.get(name)
            plan.parameters[name] = ParameterPlan(
                "vocab" if tied is not None else "colwise",
                ("tied with the embedding: one row split; " if tied else "") +
                "LM head: vocabulary split, cross-entropy from local max and sum-exp reduced across ranks")
            continue
        try:
            rows = walk_column(linear, tp)
        except NotSplittable as e:
            plan.parameters.setdefault(name, ParameterPlan("replicate", f"left whole: {e}"))
            continue
        if not rows:
            plan.parameters.setdefault(name, ParameterPlan("replicate", "its output reaches no other linear"))
            continue
        readers = ", ".join(sorted(weight_name(r, 1) or r.name for r in rows))
        plan.parameters[name] = ParameterPlan("colwise", f"output features split; read by {readers}")
        for row in rows:
            plan.parameters[weight_name(row, 1)] = ParameterPlan(
                "rowwise", f"reads split features in {layer_of(row) or 'the top level'}; output all-reduced")
        bias = linear.args[2] if len(linear.args) > 2 else None
        if isinstance(bias, fx.Node) and weight_name(linear, 2):
            plan.parameters[weight_name(linear, 2)] = ParameterPlan("colwise", f"bias of {name}")
    replicated_kv(plan, linears)
    for node in gm.graph.nodes:
        if is_parameter(node):
            plan.parameters.setdefault(input_slot(node).target, ParameterPlan("replicate", "not a projection"))
    return plan


def replicated_kv(plan: TensorParallelPlan, linears: list[fx.Node]) -> None:
    """A projection left whole beside split siblings (grouped-query key/value heads that tp does
    not divide): kept whole on every rank, which uses the heads its own query heads read."""
    for linear in linears:
        name = weight_name(linear, 1)
        mine = plan.parameters.get(name)
        if mine is None or mine.style != "replicate" or "does not divide" not in mine.why:
            continue
        siblings = [n for n in linears if n is not linear and n.args[0] is linear.args[0]]
        if any(plan.style(weight_name(n, 1)) == "colwise" for n in siblings):
            plan.kv_replicated.append(name)
            mine.why = f"key/value heads not divisible by tp={plan.tp}: whole on every rank ({mine.why})"


def check_plan(plan, gm: fx.GraphModule, heads: list[fx.Node]) -> None:
    """Refuse what the rewrite cannot do, naming the parameters and what to do; keep whole an LM
    head whose loss is none the vocabulary-parallel cross-entropy computes (and its tied table)."""
    split_heads = {weight_name(h, 1) for h in heads}
    for head in heads:
        if weight_name(head, 2):
            plan.parameters[weight_name(head, 2)] = ParameterPlan("colwise", f"bias of the LM head {weight_name(head, 1)}")
    for name, p in list(plan.parameters.items()):
        if "LM head" in p.why and name not in split_heads:
            plan.parameters[name] = ParameterPlan("replicate", "LM head kept whole: its loss is not a "
                                                  "cross-entropy the vocabulary-parallel loss computes")
    for node in gm.graph.nodes:  # a table read by the embedding and by a whole head (tied) stays whole
        if node.target is aten.embedding.default and plan.style(weight_name(node, 0) or "") == "vocab":
            table = viewed_source(node.args[0], through_copies=True)
            whole_heads = [u for u in table.users if u.target is LINEAR_CROSS_ENTROPY and u not in heads]
            if whole_heads or any(u.target in LINEARS for u in table.users):
                plan.parameters[weight_name(node, 0)] = ParameterPlan(
                    "replicate", "tied with the LM head, which is kept whole")
