"""tensor_parallel: Megatron tensor parallelism inside the captured step, its plan read from the graph.

Forward stage. The plan (`picofx.passes.tensor_parallel.plan.infer_plan`, or the user's patterns on top) says
per parameter: "colwise" (output features split: Shard(0) of the weight and bias), "rowwise"
(input features split: Shard(1)), "vocab" (embedding rows split) or "replicate". The graph is
rewritten so that every rank computes on its pieces:

    x = tp_copy(x)                     # before the column-parallel linears reading x: their input
    q = linear(x, w_q_local)           #   gradient, partial on each rank, is summed in the backward
    ... views and expands on the way take 1/tp of the heads ...
    o = tp_reduce(linear(a, w_o_local)) (+ bias)   # the row-parallel partial sums, summed
    e = tp_reduce(where(in_shard, embedding(w_local, ids - start), 0))   # vocabulary-parallel lookup

`picofx.parallel.collectives` holds the operators: at capture they are the autograd boundary
(tp_copy's backward is the all-reduce of the input gradient). Partitioned stage: in the forward
and backward graphs that run, each becomes torch's functional collective, issued and waited in
separate nodes, and is scheduled as Megatron does (picofx.parallel.lower). The
decision is recorded as a TensorParallelLayout on the graph; the runtime
(picofx.runtime.tensor_parallel) makes the model's parameters DTensors with those placements and
feeds the graph their local pieces.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

import picofx.parallel.collectives  # noqa: F401  (registers torch.ops.picofx.tp_reduce / tp_copy)
from picofx.capture.annotate import fake_mode_of
from picofx.capture.vocabulary import (COPY_PACKETS, input_slot, is_parameter, is_view, layer_of_path,
                                       traced_module_path, viewed_source)
from picofx.cost.partition import forward_region
from picofx.passes.tensor_parallel.plan import (LINEARS, ParameterPlan, check_plan, infer_plan, walk_column,
                                                weight_name)
from picofx.manager import Context, GraphRole, PassInfo, PassResult, Stage, register_pass
from picofx.parallel.layouts import TensorParallelEntry, TensorParallelLayout, layouts_of
from picofx.parallel.lower import lower_collectives
from picofx.parallel.mesh import resolve_dim
from picofx.parallel.stage_inputs import received_sequence_shards
from picofx.passes.tensor_parallel.async_overlap import overlap_sequence_parallel
from picofx.passes.tensor_parallel.loss import fused_losses, vocabulary_parallel_loss

aten = torch.ops.aten
STYLES = ("colwise", "rowwise", "vocab", "replicate")
SPLIT_DIM = {"colwise": 0, "vocab": 0, "rowwise": 1}
RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default}


@register_pass("tensor_parallel")
@dataclass(frozen=True)
class TensorParallel:
    """mesh: the ranks to split over: a mesh dimension's name, a one-dimensional DeviceMesh or a
    ProcessGroup (None: the run's mesh's tp dimension, else every rank). plan: "auto" (read from the
    graph) or {parameter-name pattern: "colwise" | "rowwise" | "vocab" | "replicate"}, applied over
    the inferred plan. sequence_parallel: norms and residual adds on sequence shards (an all-gather
    before each column-parallel block, a reduce-scatter after each row-parallel one). async_overlap:
    with sequence_parallel, those gathers and scatters are split into chunks overlapped with the
    linears they feed or follow (picofx.passes.tensor_parallel.async_overlap)."""

    mesh: Any = None
    plan: Any = "auto"
    sequence_parallel: bool = False
    async_overlap: bool = True
    # It reads the model's own linears on whole parameters, each pipeline stage's graph once cut.
    # It splits the head of the loss fuse_loss made (added by the manager when not given).
    info = PassInfo(Stage.FORWARD, also_at=(Stage.JOINT, Stage.PARTITIONED), mesh_dims=("tp",), communicates=True,
                    runs_before=("fuse", "precision", "shard"), runs_after=("pipeline",), requires=("fuse_loss",))

    def __post_init__(self):
        if self.plan != "auto" and not (isinstance(self.plan, dict) and set(self.plan.values()) <= set(STYLES)):
            raise ValueError(f"TensorParallel(plan=...): 'auto' or a dict of parameter-name patterns to one of "
                             f"{STYLES}, got {self.plan!r}")

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        if ctx.stage is Stage.JOINT:
            return regather_in_backward(gm) if self.sequence_parallel else PassResult(False, {})
        if ctx.stage is Stage.PARTITIONED:
            return self.lower(gm, ctx)
        dim = resolve_dim(self.mesh, ctx.mesh, "tp", "the tensor_parallel pass")
        plan = infer_plan(gm, dim.size)
        for pattern, style in (self.plan.items() if isinstance(self.plan, dict) else ()):
            for name in plan.parameters:
                if fnmatch.fnmatch(name, pattern):
                    plan.parameters[name] = ParameterPlan(style, f"the user's plan: {pattern!r}")
        heads = split_heads(gm, plan)
        check_plan(plan, gm, heads)
        exchange = Exchange(dim, SEQUENCE_DIM if self.sequence_parallel else None)
        if self.sequence_parallel:  # a later pipeline stage receives its residual stream as sequence shards
            received = received_sequence_shards(gm, SEQUENCE_DIM, dim.size)
            check_sequence_parallel(gm, plan, dim.size, received)
            exchange.leaving += received
        rewrite(gm, plan, exchange)
        for fused in heads:
            vocabulary_parallel_loss(gm.graph, fused, dim.rank, exchange.join, vocabulary(fused))
        notes = {}
        if self.sequence_parallel:
            notes["sequence_parallel_saves"] = f"{exchange.saved_bytes(gm.graph) / 2**20:.2f} MiB of activations"
            exchange.sum_shard_gradients(gm.graph, plan)
        entries = []
        for node in gm.graph.nodes:
            if is_parameter(node):
                name = input_slot(node).target
                style = plan.style(name)
                why = plan.parameters[name].why if name in plan.parameters else ""
                axis = SPLIT_DIM.get(style)
                local = None if axis is None else node.meta["val"].shape[axis]
                if local is not None and local * dim.size != node.meta["full_shape"][axis]:
                    notes.setdefault("padded", []).append(f"{name}: {node.meta['full_shape'][axis]} rows padded "
                                                          f"to {local * dim.size}")
                entries.append(TensorParallelEntry(name, style, axis, tuple(node.meta["full_shape"]), why, local))
        layouts_of(gm).tensor_parallel = TensorParallelLayout(dim, tuple(entries), self.sequence_parallel)
        counts = {style: sum(1 for e in entries if e.style == style) for style in STYLES}
        return PassResult(True, {"ranks": dim.size, **counts, **notes})

    def lower(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        """The graphs that run: sequence parallelism's collectives chunked (async_overlap), then
        every collective torch's functional one, issue and wait apart, scheduled (lower.py)."""
        notes = {"chunked": overlap_sequence_parallel(gm)} if self.async_overlap and self.sequence_parallel else {}
        dim = resolve_dim(self.mesh, ctx.mesh, "tp", "the tensor_parallel pass")
        notes.update(lower_collectives(gm, dim.group_name, backward=ctx.graph_role is GraphRole.BACKWARD))
        return PassResult(bool(notes["lowered"]) or any(notes.get("chunked", {}).values()), notes)


def regather_in_backward(joint: fx.GraphModule) -> PassResult:
    """Sequence parallel as Megatron runs it: in each decoder layer the backward gathers a
    linear's input from the sequence shard again rather than keeping the gathered rows from the
    forward, so what a layer saves stays split over the ranks (each gather and its views tagged to
    recompute). The LM head's gathered input is left to the partitioner: re-gathering it made the
    loss keep its exponentials beside the logits, a larger forward peak for one hidden row."""
    forward = forward_region(joint)
    tagged = 0
    for node in joint.graph.nodes:
        if node in forward and node.target is torch.ops.picofx.sp_gather.default and in_a_layer(node):
            pending = [node]
            while pending:
                n = pending.pop()
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                pending += [u for u in n.users if u in forward and (is_view(u) or getattr(u.target, "overloadpacket", None)
                                                                      in COPY_PACKETS)]
            tagged += 1
    return PassResult(tagged > 0, {"regathered": tagged})


def in_a_layer(node: fx.Node) -> bool:
    return layer_of_path(traced_module_path(node)) is not None


SEQUENCE_DIM = 1  # the residual stream is (batch, sequence, hidden)


@dataclass
class Exchange:
    """The collectives the rewrite inserts: where split features join (before column-parallel
    linears) and where partial sums leave (after row-parallel ones, the vocabulary-parallel
    lookup). Tensor parallel: tp_copy and tp_reduce. Sequence parallel: the residual stream
    between them lives on sequence shards, so an all-gather joins and a reduce-scatter leaves."""

    dim: Any
    sequence_dim: int | None = None
    leaving: list = field(default_factory=list)
    joining: list = field(default_factory=list)

    def join(self, graph: fx.Graph, x: fx.Node) -> fx.Node:
        if self.sequence_dim is None:
            node = graph.call_function(torch.ops.picofx.tp_copy.default, (x, self.dim.group_name))
        else:
            node = graph.call_function(torch.ops.picofx.sp_gather.default,
                                       (x, self.sequence_dim, self.dim.size, self.dim.group_name))
            node.meta["nn_module_stack"] = x.meta.get("nn_module_stack", {})  # the layer it gathers for
        self.joining.append(node)
        return node

    def leave(self, graph: fx.Graph, y: fx.Node) -> fx.Node:
        if self.sequence_dim is None:
            node = graph.call_function(torch.ops.picofx.tp_reduce.default, (y, self.dim.group_name))
        else:
            node = graph.call_function(torch.ops.picofx.sp_scatter.default,
                                       (y, self.sequence_dim, self.dim.size, self.dim.group_name))
        self.leaving.append(node)
        return node

    def sharded_region(self) -> set:
        """The nodes between a reduce-scatter and the next all-gather: they run on sequence shards."""
        region, frontier = set(), [u for n in self.leaving for u in n.users]
        while frontier:
            node = frontier.pop()
            if node in region or node in self.joining or node.op == "output":
                continue
            region.add(node)
            frontier += list(node.users)
        return region

    def saved_bytes(self, graph: fx.Graph) -> float:
        """Activations the residual stream keeps per rank less under sequence parallelism: the
        (whole-sequence) bytes of its nodes times (tp - 1) / tp."""
        return sum(n.meta.get("bytes", 0) for n in self.sharded_region()) * (self.dim.size - 1) / self.dim.size

    def sum_shard_gradients(self, graph: fx.Graph, plan) -> None:
        """A whole parameter read on sequence shards (a norm's weight, a row's bias) gets a partial
        gradient on each rank, from its tokens: tp_copy sums them in the backward."""
        region = self.sharded_region()
        for node in list(graph.nodes):
            if is_parameter(node) and plan.style(input_slot(node).target) == "replicate":
                inside = [u for u in node.users if u in region]
                if inside:
                    with graph.inserting_after(node):
                        summed = graph.call_function(torch.ops.picofx.tp_copy.default, (node, self.dim.group_name))
                    for user in inside:
                        user.replace_input_with(node, summed)


def check_sequence_parallel(gm: fx.GraphModule, plan, tp: int, received=()) -> None:
    """The residual stream starts at a vocabulary-parallel lookup (its partial rows reduce-scattered),
    or arrives in shards from the pipeline stage before, and its sequence divides over the ranks."""
    lookups = [n for n in gm.graph.nodes if n.target is aten.embedding.default and weight_name(n, 0)]
    if not (lookups or received) or any(plan.style(weight_name(n, 0)) != "vocab" for n in lookups):
        raise ValueError("TensorParallel(sequence_parallel=True): the token embedding must be split over the "
                         "vocabulary (plan 'vocab'), where the residual stream's sequence shards begin.")
    for lookup in lookups:
        shape = tuple(lookup.meta["val"].shape)
        if len(shape) != 3 or shape[SEQUENCE_DIM] % tp:
            raise ValueError(f"TensorParallel(sequence_parallel=True): the residual stream {shape} must be "
                             f"(batch, sequence, hidden) with a sequence tp={tp} divides.")


def split_heads(gm: fx.GraphModule, plan) -> list[fx.Node]:
    """The fused losses (pass fuse_loss made them: the forms fuse's loss rule recognises) whose
    head the plan splits over the vocabulary; a loss left unfused keeps its head whole."""
    return [n for n in fused_losses(gm.graph) if plan.style(weight_name(n, 1) or "") in ("colwise", "vocab")]


def rewrite(gm: fx.GraphModule, plan, exchange: Exchange) -> None:
    graph, tp = gm.graph, exchange.dim.size
    shrink_placeholders(gm, plan, tp)
    copies: dict[fx.Node, fx.Node] = {}
    linears = [n for n in graph.nodes if n.target in LINEARS]
    walks = {}  # every column's path, read before anything changes (siblings are recognised by their input)
    for linear in linears:
        if plan.style(weight_name(linear, 1) or "") == "colwise":
            walks[linear] = {}
            walk_column(linear, tp, walks[linear])
    for linear in linears:
        style = plan.style(weight_name(linear, 1) or "")
        if style == "colwise":
            for node, at in walks[linear].items():
                if node.target in RESHAPES:
                    shape = list(node.meta["val"].shape)
                    shape[at] //= tp
                    node.args = (node.args[0], shape, *node.args[2:])
            source = linear.args[0]
            if source not in copies:
                with graph.inserting_after(source):
                    copies[source] = exchange.join(graph, source)
            linear.replace_input_with(source, copies[source])
        elif style == "rowwise":
            bias = linear.args[2] if len(linear.args) > 2 else None
            linear.args = linear.args[:2]
            with graph.inserting_after(linear):
                reduced = exchange.leave(graph, linear)
            linear.replace_all_uses_with(reduced, delete_user_cb=lambda u: u is not reduced)
            if bias is not None:
                with graph.inserting_after(reduced):
                    biased = graph.call_function(aten.add.Tensor, (reduced, bias))
                reduced.replace_all_uses_with(biased, delete_user_cb=lambda u: u is not biased)
    for lookup in [n for n in graph.nodes if n.target is aten.embedding.default]:
        if plan.style(weight_name(lookup, 0) or "") == "vocab":
            vocabulary_parallel(graph, lookup, exchange)
    if plan.kv_replicated:
        replicated_key_values(graph, linears, plan, exchange, copies)


def shrink_placeholders(gm: fx.GraphModule, plan, tp: int) -> None:
    """Each split parameter's placeholder takes this rank's piece (its fake value resized)."""
    mode = fake_mode_of(gm)
    for node in gm.graph.nodes:
        if not is_parameter(node):
            continue
        value = node.meta["val"]
        node.meta["full_shape"] = tuple(value.shape)
        axis = SPLIT_DIM.get(plan.style(input_slot(node).target))
        if axis is None:
            continue
        name = input_slot(node).target
        if value.shape[axis] % tp and not paddable(plan, name):
            raise ValueError(f"TensorParallel: {name} has {value.shape[axis]} "
                             f"{'rows' if axis == 0 else 'columns'}, which tp={tp} does not divide.")
        shape = list(value.shape)
        shape[axis] = -(-shape[axis] // tp)  # a vocabulary tp does not divide: padded rows, as Megatron pads
        with mode:
            node.meta["val"] = torch.empty(shape, dtype=value.dtype, device=value.device)


def paddable(plan, name: str) -> bool:
    """An embedding table or LM head (and its bias): rows are tokens, so zero rows past the
    vocabulary are never looked up, and the loss masks their logits out."""
    p = plan.parameters.get(name)
    return p is not None and (p.style == "vocab" or "LM head" in p.why)


def vocabulary(fused: fx.Node) -> int:
    """The real vocabulary of a fused loss's head: its weight placeholder's whole rows."""
    source = viewed_source(fused.args[1], through_copies=True)
    while source.op == "call_function" and source.target is aten._to_copy.default:
        source = viewed_source(source.args[0], through_copies=True)
    return source.meta.get("full_shape", source.meta["val"].shape)[0]


def replicated_key_values(graph: fx.Graph, linears: list, plan, exchange: Exchange, copies: dict) -> None:
    """Key/value projections whose heads tp does not divide stay whole on every rank (Megatron's
    replication): each reads the summed-in-backward input and its weight's gradient, partial (from
    this rank's heads), is summed over the ranks; at each attention, the repeated key/value heads
    are sliced to those this rank's query heads read."""
    whole = [n for n in linears if weight_name(n, 1) in plan.kv_replicated]
    for linear in whole:
        source = linear.args[0]
        if source in copies:
            linear.replace_input_with(source, copies[source])
        for position in range(1, len(linear.args)):
            param = linear.args[position]
            if isinstance(param, fx.Node) and is_parameter(param):
                with graph.inserting_after(param):
                    summed = graph.call_function(torch.ops.picofx.tp_copy.default, (param, exchange.dim.group_name))
                linear.replace_input_with(param, summed)
    for attention in [n for n in graph.nodes if n.target is aten.scaled_dot_product_attention.default]:
        heads = attention.args[0].meta["val"].shape[1]
        mine = heads // exchange.dim.size
        for kv in attention.args[1:3]:
            if not set(reads_linears(kv)) & set(whole):
                continue
            kv_heads = kv.meta["val"].shape[1]
            group = heads // kv_heads  # query heads per key/value head (1: already repeated)
            if mine % group and group % mine:
                raise ValueError(f"TensorParallel: {attention.name} has {heads} query heads over {kv_heads} "
                                 f"key/value heads; tp={exchange.dim.size} gives a rank query heads of several "
                                 "key/value groups in part.")
            start = exchange.dim.rank * mine // group
            stop = -(-(exchange.dim.rank + 1) * mine // group)
            with graph.inserting_before(attention):
                sliced = graph.call_function(aten.slice.Tensor, (kv, 1, start, stop))
            attention.replace_input_with(kv, sliced)


def reads_linears(node: fx.Node, depth: int = 40) -> list[fx.Node]:
    """The linears `node` is computed from, through anything but other linears."""
    found, frontier, seen = [], [node], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n in seen or n.op != "call_function":
                continue
            seen.add(n)
            if n.target in LINEARS:
                found.append(n)
            else:
                nxt += n.all_input_nodes
        frontier = nxt
    return found


def vocabulary_parallel(graph: fx.Graph, lookup: fx.Node, exchange: Exchange) -> None:
    """This rank's rows [start, start + rows) answer the ids that fall in them; the others give
    zeros; the sum over ranks is the whole lookup."""
    table, ids = lookup.args[0], lookup.args[1]
    rows = table.meta["val"].shape[0]
    start = exchange.dim.rank * rows
    with graph.inserting_before(lookup):
        local = graph.call_function(aten.sub.Tensor, (ids, start))
        below = graph.call_function(aten.lt.Scalar, (local, 0))
        above = graph.call_function(aten.ge.Scalar, (local, rows))
        outside = graph.call_function(aten.logical_or.default, (below, above))
        safe = graph.call_function(aten.where.ScalarSelf, (outside, 0, local))
    lookup.replace_input_with(ids, safe)
    with graph.inserting_before(lookup.next):
        mask = graph.call_function(aten.unsqueeze.default, (outside, -1))
        zeroed = graph.call_function(aten.where.ScalarSelf, (mask, 0.0, lookup))
        reduced = exchange.leave(graph, zeroed)
    lookup.replace_all_uses_with(reduced, delete_user_cb=lambda u: u not in (zeroed,))
