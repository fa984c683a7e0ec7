"""context_parallel: each rank of the cp dimension computes its part of every sequence.

Every rank of a cp group is called with the same batch of whole sequences. Forward stage: the
token ids are indexed to this rank's positions right before the embedding lookup, and the split
is carried through the graph (picofx.passes.context_parallel.split):

    ids = index_select(ids, 1, kept)              # (B, T/cp): chunks i and 2·cp−1−i with load_balance
    cos = index_select(cos, seq, kept)            # a whole table meeting the tokens: each keeps its position
    k = sp_gather(k, 2, cp, group)                # the kv heads, before repeat_kv; backward: reduce-scatter
    o = sdpa(q, k, v, attn_mask=mask[kept][:, keys])   # this rank's queries over every key
    labels = index_select(labels, 0, kept_flat)   # where the (shifted) labels meet the local logits
    loss = tp_reduce(sum(token losses) / count)   # count: from the whole labels, the same on every rank
    w = tp_copy(w, group)                         # each parameter: its gradient summed over cp

so the loss and every gradient equal one process on the whole sequence. Where a data-parallel
pass's group spans cp (shard over dp_shard x cp, overlap over dp_replicate x cp), that pass takes
the tp_copy sums out and its own bucketed collective sums over cp. Outputs other than the
loss (logits) are gathered back into sequence order, without gradient. Partitioned stage: the
operators become torch's functional collectives (picofx.parallel.lower). The gradient sums over cp,
and the finders the data-parallel passes use, are in picofx.parallel.gradient_sums.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

import picofx.parallel.collectives  # noqa: F401  (registers torch.ops.picofx.tp_reduce / tp_copy / sp_gather)
from picofx.capture.annotate import fake_mode_of
from picofx.capture.vocabulary import USER, input_kind
from picofx.manager import Context, PassInfo, PassResult, Stage, register_pass
from picofx.parallel.layouts import recorded
from picofx.parallel.gradient_sums import sum_parameter_gradients
from picofx.parallel.lower import lower_collectives
from picofx.parallel.mesh import resolve_dim
from picofx.parallel.stage_inputs import received_sequence_shards
from picofx.passes.context_parallel.attention import Attention, RingAttention
from picofx.passes.context_parallel.positions import Positions, check_divisible
from picofx.passes.context_parallel.ring import lower_ring
from picofx.passes.context_parallel.split import KEYS, PARTIAL, Local, SequenceSplit, is_pointwise

aten = torch.ops.aten
METHODS = {"allgather": Attention, "ring": RingAttention}


@register_pass("context_parallel")
@dataclass(frozen=True)
class ContextParallel:
    """mesh: the ranks that split the sequence: a mesh dimension's name, a one-dimensional
    DeviceMesh or a ProcessGroup (None: the run's mesh's cp dimension, else every rank).
    method: "allgather" (each attention all-gathers the keys and values) or "ring" (key/value
    blocks passed around the cp ring, merged by log-sum-exp). load_balance: the
    head-tail split (rank i keeps chunks i and 2·cp−1−i of 2·cp), so that causal attention costs
    every rank the same; without it, rank i keeps chunk i of cp."""

    mesh: Any = None
    method: str = "allgather"
    load_balance: bool = True
    info = PassInfo(Stage.FORWARD, also_at=(Stage.PARTITIONED,), mesh_dims=("cp",), communicates=True,
                    runs_before=("fuse", "precision", "shard", "overlap"), runs_after=("pipeline",))

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"ContextParallel(method={self.method!r}): the methods are {tuple(METHODS)}.")

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        dim = resolve_dim(self.mesh, ctx.mesh, "cp", "the context_parallel pass")
        if ctx.stage is Stage.PARTITIONED:
            if ctx.backend == "inductor":
                from torch._inductor.decomposition import select_decomp_table
            rings = lower_ring(gm, select_decomp_table() if ctx.backend == "inductor" else None)
            notes = lower_collectives(gm, dim.group_name, backward=False)
            return PassResult(bool(notes["lowered"]) or bool(rings), {**notes, "rings": rings})
        graph, mode = gm.graph, fake_mode_of(gm)
        token_ids, stage = token_lookups(graph), recorded(gm).stage
        received = received_sequence_shards(gm, 1, 1)  # a later pipeline stage's activations (sized as they are)
        if not token_ids and not received:
            raise ValueError("ContextParallel: found no embedding lookup of (batch, sequence) token ids given to the "
                             "model; the sequence is split where the tokens enter it.")
        placed = recorded(gm).tensor_parallel  # sequence parallelism receives 1/tp of each sequence's tokens
        shards = placed.world if placed is not None and placed.sequence_parallel else 1
        lengths = {n: n.meta["val"].shape[1] for n in token_ids} | {n: n.meta["val"].shape[1] * shards
                                                                     for n in received}
        length = next(iter(lengths.values()))
        for start, whole in lengths.items():
            check_divisible(whole, dim.size, self.load_balance,
                            f"input {start.name} {tuple(start.meta['val'].shape)}")
        if any(whole != length for whole in lengths.values()):
            raise ValueError("ContextParallel: the token lookups read sequences of different lengths; give one.")
        starts = list(lengths)
        anchor = [n for n in graph.nodes if n.op == "placeholder"][-1].next  # after every input
        positions = Positions(graph, length, dim.size, dim.rank, self.load_balance,
                              starts[0].meta["val"].device, anchor, mode)
        attention = METHODS[self.method](graph, positions, dim)
        if not attention.attentions and stage is None:
            raise ValueError("ContextParallel: found no attention (aten.scaled_dot_product_attention) in the graph; "
                             "context parallelism splits attention written with F.scaled_dot_product_attention.")
        split = SequenceSplit(gm, positions, attention, mode)
        for node in received_sequence_shards(gm, 1, dim.size):  # sent as this rank's tokens by the stage before
            split.states[node] = Local(1)
        split.run(token_ids)
        attention.drop_unread_masks()
        last = stage is None or stage.index == stage.num_stages - 1
        outputs = combine_outputs(graph, split, dim) if last else {"sent_local": len(graph.output_node().args[0])}
        summed = sum_parameter_gradients(graph, dim.group_name)
        return PassResult(True, {"ranks": dim.size, "tokens_per_rank": length // dim.size,
                                 "load_balance": self.load_balance, "attentions": len(attention.attentions),
                                 "method": self.method, "gathered": sum(len(s) for s in attention.sources.values())
                                 if self.method == "allgather" else 0,
                                 "outputs": outputs, "gradients_summed": summed})


def token_lookups(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """The (batch, sequence) token ids the model is called with, each with the nodes that lead it to
    an embedding lookup: the lookup itself, or tensor_parallel's vocabulary-parallel shift and mask
    on the way (elementwise)."""
    found: dict[fx.Node, list[fx.Node]] = {}
    for lookup in (n for n in graph.nodes if n.target is aten.embedding.default):
        readers, pending, sources = set(), [lookup], set()
        while pending:
            node = pending.pop()
            index = node.args[1] if node is lookup else None
            for arg in ([index] if index is not None else node.all_input_nodes):
                if arg.op == "placeholder":
                    sources.add(arg)
                    readers.add(node)
                elif arg is index or is_pointwise(arg.target):
                    pending.append(arg)
        if len(sources) == 1 and input_kind(ids := sources.pop()) == USER and ids.meta["val"].dim() == 2:
            found.setdefault(ids, []).extend(sorted(readers - set(found.get(ids, ())), key=list(graph.nodes).index))
    return found


def combine_outputs(graph: fx.Graph, split: SequenceSplit, dim) -> dict:
    """The loss's per-rank share summed over cp; local outputs gathered back into sequence order."""
    output = graph.output_node()
    done = {"summed": 0, "gathered": 0}

    def combine(node: fx.Node) -> fx.Node:
        state = split.states.get(node)
        if state is None:
            return node
        if state == KEYS:
            raise ValueError(f"ContextParallel: the model returns {node.name}, the gathered keys or values.")
        with graph.inserting_before(output):
            if state == PARTIAL:
                done["summed"] += 1
                out = graph.call_function(torch.ops.picofx.tp_reduce.default, (node, dim.group_name))
                split.refresh(out)
                return out
            if state != Local(state.dim):
                raise ValueError(f"ContextParallel: the model returns {node.name}, whose sequence is merged with "
                                 "other dimensions; return it (batch, sequence, ...) or return only the loss.")
            detached = graph.call_function(aten.detach.default, (node,))
            gathered = graph.call_function(torch.ops.picofx.sp_gather.default,
                                           (detached, state.dim, dim.size, dim.group_name))
            ordered = graph.call_function(aten.index_select.default, (gathered, state.dim, split.positions.restore()))
        for n in (detached, gathered, ordered):
            split.refresh(n)
        done["gathered"] += 1
        return ordered

    output.args = fx.map_arg(output.args, combine)
    return done
