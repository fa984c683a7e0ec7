"""Attention under context parallelism, the all-gather method (Llama 3's): each rank's queries
attend over every key and value, all-gathered over the cp ranks.

The gather sits before the views that repeat key/value heads for grouped-query attention, so only
the kv heads travel; its backward is a reduce-scatter (picofx::sp_gather), which sums into each
rank the gradients that every rank's queries sent to its keys. The gathered keys come in rank
order (rank 0's positions, then rank 1's), so the mask is indexed to match: the causal mask is
made for this rank's query positions against the gathered key positions, and a mask the model
built from its inputs (whole on every rank) is indexed to the same rows and columns.
"""
from __future__ import annotations

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

import picofx.parallel.collectives  # noqa: F401  (registers torch.ops.picofx.sp_gather)
from picofx.passes.context_parallel.split import KEY_VIEWS, CannotSplit, Local

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


class Attention:
    def __init__(self, graph: fx.Graph, positions, dim):
        self.graph, self.positions, self.dim = graph, positions, dim
        self.sources: dict[fx.Node, list[fx.Node]] = {}  # first node reading gathered keys -> what it gathers
        self.attentions = [n for n in graph.nodes if n.target is SDPA]
        for attention in self.attentions:
            for kv in attention.args[1:3]:
                consumer, source = attention, kv
                while source.target in KEY_VIEWS and len(source.users) == 1:  # repeat_kv's views
                    consumer, source = source, source.args[0]
                self.sources.setdefault(consumer, []).append(source)

    def gathered_before(self, node: fx.Node) -> list[fx.Node]:
        return self.sources.get(node, [])

    def gather(self, consumer: fx.Node, source: fx.Node, state) -> fx.Node:
        """All-gather `source` (this rank's keys or values, (batch, heads, T/cp, head_dim)) over cp,
        just before `consumer`, its first reader."""
        at = len(source.meta["val"].shape) - 2
        if state != Local(at):
            raise CannotSplit(consumer, f"the keys or values {source.name} are not this rank's tokens laid out "
                                        "(batch, heads, sequence, head_dim)")
        with self.graph.inserting_before(consumer):
            gathered = self.graph.call_function(torch.ops.picofx.sp_gather.default,
                                                (source, at, self.dim.size, self.dim.group_name))
        consumer.replace_input_with(source, gathered)
        return gathered

    def rewrite(self, split, node: fx.Node) -> Local:
        """This rank's queries over the gathered keys and values, under the mask indexed to them."""
        a = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
        query, mask = a["query"], a.get("attn_mask")
        rows = len(split.whole[query]) - 2
        if split.states.get(query) != Local(rows):
            raise CannotSplit(node, "its queries are not this rank's tokens laid out (batch, heads, sequence, "
                                    "head_dim)")
        if mask is None:
            mask = self.positions.causal_mask() if a.get("is_causal", False) else None
        elif split.states.get(mask) is None:
            whole = split.whole[mask]
            picked = mask
            for at, index in ((len(whole) - 2, self.positions.kept()), (len(whole) - 1, self.positions.keys())):
                if whole[at] != 1:
                    with self.graph.inserting_before(node):
                        picked = self.graph.call_function(aten.index_select.default, (picked, at, index))
                    split.refresh(picked)
            mask = picked
        else:
            raise CannotSplit(node, "its mask is computed from the split tokens; context parallelism splits a "
                                    "mask built from the inputs (positions, padding) or is_causal")
        node.args = (query, a["key"], a["value"])
        node.kwargs = {**{k: v for k, v in a.items() if k not in ("query", "key", "value")},
                       "attn_mask": mask, "is_causal": False}
        split.refresh(node)
        return Local(rows)
