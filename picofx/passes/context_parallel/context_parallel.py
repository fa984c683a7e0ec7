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

so the loss and every gradient equal one process on the whole sequence. Outputs other than the
loss (logits) are gathered back into sequence order, without gradient. Partitioned stage: the
operators become torch's functional collectives (picofx.passes.tensor_parallel.lower).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

import picofx.parallel.collectives  # noqa: F401  (registers torch.ops.picofx.tp_reduce / tp_copy / sp_gather)
from picofx.capture.annotate import fake_mode_of
from picofx.capture.vocabulary import USER, input_kind, is_parameter
from picofx.manager import Context, PassInfo, PassResult, Stage, register_pass
from picofx.parallel.mesh import resolve_dim
from picofx.passes.context_parallel.attention import Attention
from picofx.passes.context_parallel.positions import Positions, check_divisible
from picofx.passes.context_parallel.split import KEYS, PARTIAL, Local, SequenceSplit
from picofx.passes.tensor_parallel.lower import lower_collectives

aten = torch.ops.aten
METHODS = ("allgather",)


@register_pass("context_parallel")
@dataclass(frozen=True)
class ContextParallel:
    """mesh: the ranks that split the sequence: a mesh dimension's name, a one-dimensional
    DeviceMesh or a ProcessGroup (None: the run's mesh's cp dimension, else every rank).
    method: "allgather" (each attention all-gathers the keys and values). load_balance: the
    head-tail split (rank i keeps chunks i and 2·cp−1−i of 2·cp), so that causal attention costs
    every rank the same; without it, rank i keeps chunk i of cp."""

    mesh: Any = None
    method: str = "allgather"
    load_balance: bool = True
    info = PassInfo(Stage.FORWARD, also_at=(Stage.PARTITIONED,), mesh_dims=("cp",), communicates=True,
                    runs_before=("fuse", "precision", "shard", "overlap"))

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"ContextParallel(method={self.method!r}): the methods are {METHODS}; the ring "
                             "method is not built yet.")

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        dim = resolve_dim(self.mesh, ctx.mesh, "cp", "the context_parallel pass")
        if ctx.stage is Stage.PARTITIONED:
            notes = lower_collectives(gm, dim.group_name, backward=False)
            return PassResult(bool(notes["lowered"]), notes)
        graph, mode = gm.graph, fake_mode_of(gm)
        lookups = token_lookups(graph)
        length = lookups[0].args[1].meta["val"].shape[1]
        for lookup in lookups:
            ids = lookup.args[1]
            check_divisible(ids.meta["val"].shape[1], dim.size, self.load_balance,
                            f"input {ids.name} {tuple(ids.meta['val'].shape)}")
        if any(lookup.args[1].meta["val"].shape[1] != length for lookup in lookups):
            raise ValueError("ContextParallel: the token lookups read sequences of different lengths; give one.")
        anchor = next(n for n in graph.nodes if n.op != "placeholder")
        positions = Positions(graph, length, dim.size, dim.rank, self.load_balance,
                              lookups[0].args[1].meta["val"].device, anchor, mode)
        attention = Attention(graph, positions, dim)
        if not attention.attentions:
            raise ValueError("ContextParallel: found no attention (aten.scaled_dot_product_attention) in the graph; "
                             "context parallelism splits attention written with F.scaled_dot_product_attention.")
        split = SequenceSplit(gm, positions, attention, mode)
        split.run(lookups)
        outputs = combine_outputs(graph, split, dim)
        summed = sum_parameter_gradients(graph, dim.group_name)
        return PassResult(True, {"ranks": dim.size, "tokens_per_rank": length // dim.size,
                                 "load_balance": self.load_balance, "attentions": len(attention.attentions),
                                 "gathered": sum(len(s) for s in attention.sources.values()),
                                 "outputs": outputs, "gradients_summed": summed})


def token_lookups(graph: fx.Graph) -> list[fx.Node]:
    """The embedding lookups of (batch, sequence) token ids the model is called with."""
    found = [n for n in graph.nodes if n.target is aten.embedding.default and n.args[1].op == "placeholder"
             and input_kind(n.args[1]) == USER and n.args[1].meta["val"].dim() == 2]
    if not found:
        raise ValueError("ContextParallel: found no embedding lookup of (batch, sequence) token ids given to the "
                         "model; the sequence is split where the tokens enter it.")
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


def sum_parameter_gradients(graph: fx.Graph, group: str) -> int:
    """Each parameter read through tp_copy: its gradient, from this rank's tokens, summed over cp."""
    count = 0
    for node in list(graph.nodes):
        if is_parameter(node) and node.users:
            with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
                summed = graph.call_function(torch.ops.picofx.tp_copy.default, (node, group))
            summed.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(summed, delete_user_cb=lambda user: user is not summed)
            count += 1
    return count
