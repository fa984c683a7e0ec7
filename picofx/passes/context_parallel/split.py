"""The sequence split carried through the forward graph, node by node.

Each node is in one of four states:
- whole: the same on every rank, as captured (the labels, the RoPE tables, a mask built from the
  inputs); its shapes are left alone;
- Local(dim, outer, inner): this rank's tokens only; `dim` holds outer·T·inner entries when whole
  (a (batch·sequence) view: outer = batch) and outer·(T/cp)·inner here;
- KEYS: the all-gathered keys and values (whole length, in the gathered order) on their way to
  attention, through the views that repeat their heads;
- PARTIAL: this rank's share of a sum over the tokens (the loss's numerator): the sum over the cp
  ranks is the whole value.

Where a local node meets a whole one that spans the sequence (a RoPE table, the labels), the whole
one is indexed to the local tokens. Every op is either one the rules below split exactly, or
refused by name: a split that cannot be proved exact is never guessed.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import fx

import picofx.parallel.collectives  # noqa: F401  (registers the picofx collectives)

aten = torch.ops.aten


@dataclass(frozen=True)
class Local:
    dim: int
    outer: int = 1
    inner: int = 1


KEYS, PARTIAL = "keys", "partial"
RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
SAME_SHAPE = {aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
              aten.contiguous.default, aten.lift_fresh_copy.default, aten.dropout.default}
KEY_VIEWS = RESHAPES | SAME_SHAPE | {aten.expand.default, aten.unsqueeze.default}  # repeat_kv's ops
LINEAR_IN_PARTIAL = {aten.neg.default, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor,
                     *SAME_SHAPE}
NORMS = {aten.native_layer_norm.default, aten.layer_norm.default, aten.rms_norm.default}
SUMS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default}
# tensor_parallel's collectives over the other ranks of a token: elementwise across ranks, shapes kept
TP_ELEMENTWISE = {torch.ops.picofx.tp_copy.default, torch.ops.picofx.tp_reduce.default, torch.ops.picofx.tp_max.default}


class CannotSplit(ValueError):
    def __init__(self, node: fx.Node, why: str):
        super().__init__(f"ContextParallel: cannot split the sequence through {node.name} ({node.target}): {why}. "
                         "Context parallelism splits the token stream of a causal LM whose attention is "
                         "scaled_dot_product_attention and whose loss is a sum or mean over tokens; write the "
                         "model that way, or leave context_parallel out.")


def shape(node) -> tuple:
    return tuple(node.meta["val"].shape)


def is_pointwise(target) -> bool:
    return torch.Tag.pointwise in getattr(target, "tags", ()) or target in SAME_SHAPE or target in TP_ELEMENTWISE or \
        target in (aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther)


def viewed_split(before: tuple, split: Local, after: tuple, length: int) -> Local | None:
    """Where the sequence lands when a tensor of shape `before`, split as `split`, is viewed as
    `after` (views keep the flat order): the dimension of `after` whose span holds the whole
    sequence's span, or None where the view cuts the sequence."""
    low = split.inner * math.prod(before[split.dim + 1:])  # the sequence's stride in the flat order
    high = low * length
    for dim in range(len(after)):
        stride = math.prod(after[dim + 1:])
        if after[dim] > 1 and low % stride == 0 and (stride * after[dim]) % high == 0:
            return Local(dim, stride * after[dim] // high, low // stride)
    return None


def normalized(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def reduced_dims(node: fx.Node, rank: int) -> list[int]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if node.target in (aten.sum.default, aten.mean.default) or not dims:
        return list(range(rank))
    return [normalized(d, rank) for d in ([dims] if isinstance(dims, int) else dims)]


class SequenceSplit:
    """Carries the split through `gm`'s graph in order (see the module's docstring). `attention`
    (picofx.passes.context_parallel.attention.Attention) knows where the keys and values are
    gathered and rewrites each attention."""

    def __init__(self, gm: fx.GraphModule, positions, attention, fake_mode):
        self.gm, self.graph, self.positions = gm, gm.graph, positions
        self.attention, self.mode = attention, fake_mode
        self.whole = {n: shape(n) for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
        self.states: dict = {}
        self.selected: dict = {}

    @property
    def length(self) -> int:
        return self.positions.length

    def local_size(self, split: Local) -> int:
        return split.outer * self.positions.local_length * split.inner

    def run(self, token_ids: dict[fx.Node, list[fx.Node]]) -> None:
        """Split from the token ids on (`token_ids`: each ids input -> the nodes on its way to an
        embedding lookup), through the whole graph."""
        for ids, readers in token_ids.items():
            self.start(ids, readers)
        for node in list(self.graph.nodes):
            if node.op == "call_function":
                self.visit(node)

    def start(self, ids: fx.Node, readers: list[fx.Node]) -> None:
        """`readers` read this rank's token ids (batch, T/cp): its tokens from here on."""
        with self.graph.inserting_before(self.positions.anchor):
            local = self.graph.call_function(aten.index_select.default, (ids, 1, self.positions.kept()))
        for reader in readers:
            reader.replace_input_with(ids, local)
        self.states[local], self.whole[local] = Local(1), self.whole[ids]
        self.refresh(local)

    def select(self, node: fx.Node, dim: int, split: Local, before: fx.Node) -> fx.Node:
        """`node` (whole) indexed to this rank's tokens along `dim`."""
        key = (node, dim, split.outer, split.inner)
        if key not in self.selected:
            with self.graph.inserting_before(before):
                picked = self.graph.call_function(aten.index_select.default,
                                                  (node, dim, self.positions.flat(split.outer, split.inner)))
            self.refresh(picked)
            self.selected[key] = picked
        return self.selected[key]

    def refresh(self, node: fx.Node) -> None:
        """The node's fake value again, from its inputs' (their shapes changed)."""
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        with self.mode:
            node.meta["val"] = node.target(*args, **kwargs)

    def visit(self, node: fx.Node) -> None:
        for source in self.attention.gathered_before(node):
            gathered = self.attention.gather(node, source, self.states.get(source))
            self.refresh(gathered)
            self.states[gathered] = KEYS
        states = [self.states.get(n) for n in node.all_input_nodes]
        if not any(states):
            return
        if KEYS in states:
            state = self.keys(node)
        elif node.target is operator.getitem:
            state = self.states[node.args[0]]
        elif PARTIAL in states:
            state = self.partial(node)
        else:
            state = self.local(node, next(s for s in states if isinstance(s, Local)))
        self.states[node] = state
        if node.target is not aten.scaled_dot_product_attention.default:
            self.refresh(node)

    def keys(self, node: fx.Node):
        if node.target in KEY_VIEWS:
            return KEYS
        if node.target is aten.scaled_dot_product_attention.default:
            return self.attention.rewrite(self, node)
        raise CannotSplit(node, "it reads the all-gathered keys or values on their way to attention")

    def partial(self, node: fx.Node):
        kinds = [self.states.get(a) if isinstance(a, fx.Node) else None for a in node.args]
        ok = node.target in LINEAR_IN_PARTIAL and {
            aten.add.Tensor: all(k == PARTIAL for a, k in zip(node.args, kinds) if isinstance(a, fx.Node)),
            aten.sub.Tensor: all(k == PARTIAL for a, k in zip(node.args, kinds) if isinstance(a, fx.Node)),
            aten.mul.Tensor: kinds.count(PARTIAL) == 1 and not any(isinstance(k, Local) for k in kinds),
            aten.div.Tensor: kinds[0] == PARTIAL and kinds[1:].count(PARTIAL) == 0 and
            not any(isinstance(k, Local) for k in kinds)}.get(node.target, True)
        if not ok:
            raise CannotSplit(node, "it combines a per-rank share of a sum over tokens other than linearly")
        return PARTIAL

    def local(self, node: fx.Node, split: Local):
        target, rank = node.target, len(self.whole.get(node, ()))
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        d = split.dim
        if target is aten.scaled_dot_product_attention.default:
            raise CannotSplit(node, "its keys or values are local and no all-gather point was found for them")
        if target in (torch.ops.picofx.sp_scatter.default, torch.ops.picofx.sp_gather.default):
            # sequence parallelism's shards of this rank's tokens, and back: per-token ops between them
            # (a view or a whole table meeting them there would not match the shard's size, and fails)
            return split
        if is_pointwise(target):
            return self.pointwise(node)
        if target in RESHAPES:
            moved = viewed_split(self.whole[source], split, self.whole[node], self.length)
            if moved is None:
                raise CannotSplit(node, "the view cuts the sequence dimension apart")
            size = list(self.whole[node])
            size[moved.dim] = self.local_size(moved)
            node.args = (source, size)
            return moved
        if target is aten.expand.default:
            at = d + rank - len(self.whole[source])
            size = list(node.args[1])
            size[at] = -1
            node.args = (source, size)
            return Local(at, split.outer, split.inner)
        if target is aten.permute.default:
            return Local([normalized(p, rank) for p in node.args[1]].index(d), split.outer, split.inner)
        if target in (aten.transpose.int, aten.t.default):
            a, b = (normalized(x, rank) for x in node.args[1:3]) if target is aten.transpose.int else (0, 1)
            return Local(b if d == a else a if d == b else d, split.outer, split.inner)
        if target is aten.unsqueeze.default:
            return Local(d + (normalized(node.args[1], rank) <= d), split.outer, split.inner)
        if target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            before = self.whole[source]
            dims = range(len(before)) if len(node.args) < 2 else \
                [node.args[1]] if isinstance(node.args[1], int) else node.args[1]
            gone = [normalized(x, len(before)) for x in dims if before[normalized(x, len(before))] == 1]
            return Local(d - sum(1 for x in gone if x < d), split.outer, split.inner)
        if target in (aten.slice.Tensor, aten.select.int, aten.split_with_sizes.default, aten.split.Tensor):
            place = 2 if target in (aten.split_with_sizes.default, aten.split.Tensor) else 1
            at = normalized(node.args[place] if len(node.args) > place else 0, len(self.whole[source]))
            if at == d:
                raise CannotSplit(node, "it slices the sequence dimension (a shift inside the model: shift the "
                                        "labels instead, as the loss of Hugging Face's models does)")
            return Local(d - (target is aten.select.int and at < d), split.outer, split.inner)
        if target is aten.cat.default:
            if any(self.states.get(t) != split for t in node.args[0]) or normalized(node.args[1], rank) == d:
                raise CannotSplit(node, "it joins tensors split differently, or along the sequence")
            return split
        if target in (aten.native_dropout.default, aten.view_as_complex.default, aten.view_as_real.default):
            if target is aten.view_as_complex.default and d == len(self.whole[source]) - 1:
                raise CannotSplit(node, "it pairs entries along the split sequence")
            return split  # the dims before the last stay where they are
        if target in NORMS:  # over the last len(normalized_shape) dims (the features), outputs alike
            if d >= len(self.whole[source]) - len(node.args[1]):
                raise CannotSplit(node, "it normalizes over the split sequence")
            return split
        if target in (aten.linear.default, aten.mm.default, aten.addmm.default, aten.embedding.default):
            reads = {aten.embedding.default: node.args[1], aten.addmm.default: node.args[1]}.get(target, source)
            if any(isinstance(self.states.get(a), Local) for a in node.all_input_nodes if a is not reads) or \
                    (target is not aten.embedding.default and d == len(self.whole[reads]) - 1):
                raise CannotSplit(node, "it multiplies by or over the split tokens (attention written as matmuls?)")
            return split
        if target in SUMS or target in (aten.amax.default, aten.amin.default):
            dims = reduced_dims(node, len(self.whole[source]))
            if d in dims:
                if target in (aten.sum.dim_IntList, aten.sum.default):
                    return PARTIAL
                raise CannotSplit(node, "it reduces over the split sequence other than by a sum")
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            return Local(d if keep else d - sum(1 for x in dims if x < d), split.outer, split.inner)
        if target in (aten._log_softmax.default, aten._softmax.default):
            if normalized(node.args[1], rank) == d:
                raise CannotSplit(node, "a softmax over the split sequence (attention written as matmuls?)")
            return split
        if target is aten.gather.default:
            if normalized(node.args[1], rank) == d:
                raise CannotSplit(node, "it gathers along the split sequence")
            index = node.args[2]
            if self.states.get(index) is None:
                node.replace_input_with(index, self.select(index, d, split, node))
            return split
        raise CannotSplit(node, "an op the sequence split has no rule for")

    def pointwise(self, node: fx.Node) -> Local:
        """Elementwise (broadcasting): the inputs that span the sequence whole are indexed to it."""
        rank = len(self.whole[node])
        splits = {Local(s.dim + rank - len(self.whole[n]), s.outer, s.inner)
                  for n in node.all_input_nodes if isinstance(s := self.states.get(n), Local)}
        if len(splits) != 1:
            raise CannotSplit(node, f"its inputs are split along different dimensions {sorted(map(str, splits))}")
        split = splits.pop()
        for n in node.all_input_nodes:
            if self.states.get(n) is None and n in self.whole:
                at = split.dim - (rank - len(self.whole[n]))
                if at >= 0 and self.whole[n][at] != 1:
                    if self.whole[n][at] != split.outer * self.length * split.inner:
                        raise CannotSplit(node, f"{n.name} of shape {self.whole[n]} meets the split tokens but "
                                                "does not span the sequence")
                    node.replace_input_with(n, self.select(n, at, split, node))
        return split
