"""Attention under context parallelism. The all-gather method (Llama 3's): each rank's queries
attend over every key and value, all-gathered over the cp ranks (causal attention on the CPU is
computed block by block as the ring does, without a mask). The ring method: see
picofx.passes.context_parallel.ring; `RingAttention` puts its operator in place of each attention.

The gather sits before the views that repeat key/value heads for grouped-query attention, so only
the kv heads travel; its backward is a reduce-scatter (picofx::sp_gather), which sums into each
rank the gradients that every rank's queries sent to its keys. The gathered keys come in rank
order (rank 0's positions, then rank 1's), so the mask is indexed to match: the causal mask is
made for this rank's query positions against the gathered key positions, and a mask the model
built from its inputs (whole on every rank) is indexed to the same rows and columns.
"""
from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from picofx.capture.causal import erase_unread, is_causal_mask
import picofx.parallel.collectives  # noqa: F401  (registers torch.ops.picofx.sp_gather)
import picofx.passes.context_parallel.ring  # noqa: F401  (registers torch.ops.picofx.cp_ring_attention)
from picofx.passes.context_parallel.split import KEY_VIEWS, CannotSplit, Local

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


class Attention:
    def __init__(self, graph: fx.Graph, positions, dim):
        self.graph, self.positions, self.dim = graph, positions, dim
        self.sources: dict[fx.Node, list[fx.Node]] = {}  # first node reading gathered keys -> what it gathers
        self.causal_masks: dict[fx.Node, bool] = {}
        self.attentions = [n for n in graph.nodes if n.target is SDPA]
        self.in_blocks = {attention for attention in self.attentions if self.computed_in_blocks(attention)}
        for attention in self.attentions:
            if attention in self.in_blocks:
                self.sources[attention] = self.kv_heads(attention)
                continue
            for kv in attention.args[1:3]:
                consumer, source = attention, kv
                while source.target in KEY_VIEWS and len(source.users) == 1:  # repeat_kv's views
                    consumer, source = source, source.args[0]
                self.sources.setdefault(consumer, []).append(source)

    def computed_in_blocks(self, attention: fx.Node) -> bool:
        """Causal attention on the CPU without dropout: computed block by block from the gathered kv
        heads (picofx::cp_gathered_attention), no mask made."""
        a = self.arguments(attention)
        return self.positions.device.type == "cpu" and a.get("is_causal", False) and \
            a.get("attn_mask") is None and not a.get("dropout_p", 0.0)

    def kv_heads(self, attention: fx.Node) -> list[fx.Node]:
        """The attention's keys and values as kv heads: the views that repeat them for grouped-query
        attention removed (checked to repeat each kv head for consecutive query heads), for the block
        computation repeats them per block."""
        for kv in attention.args[1:3]:
            chain = []
            while kv.target in KEY_VIEWS and len(kv.users) == 1:
                chain.append(kv)
                kv = kv.args[0]
            check_heads_repeated(attention, chain[::-1], kv)
            if chain:
                attention.replace_input_with(chain[0], kv)
            for view in chain:
                self.graph.erase_node(view)
        return list(attention.args[1:3])

    def drop_unread_masks(self) -> None:
        """Erase the masks proven causal, and what only they read, once no attention reads them."""
        erase_unread(self.graph, [m for m, causal in self.causal_masks.items() if causal])

    def arguments(self, attention: fx.Node) -> dict:
        """The attention's arguments by name, a mask proven causal (`is_causal_mask`) as is_causal."""
        a = normalize_function(attention.target, attention.args, attention.kwargs,
                               normalize_to_only_use_kwargs=True).kwargs
        mask = a.get("attn_mask")
        if mask is not None and not a.get("is_causal", False):
            if mask not in self.causal_masks:
                self.causal_masks[mask] = is_causal_mask(mask)
            if self.causal_masks[mask]:
                a["attn_mask"], a["is_causal"] = None, True
        return a

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
        """This rank's queries over the gathered keys and values: causal attention on the CPU block by
        block (picofx::cp_gathered_attention), no mask made; otherwise under the mask indexed to them."""
        a, query, mask, rows = self.local_query(split, node)
        if node in self.in_blocks:
            scale = a.get("scale") or query.meta["val"].shape[-1] ** -0.5
            return self.in_place(split, node, torch.ops.picofx.cp_gathered_attention.default, (
                query, a["key"], a["value"], None, scale, True, self.dim.rank, self.dim.size,
                self.positions.load_balance), rows)
        if mask is None:
            mask = self.positions.causal_mask() if a.get("is_causal", False) else None
        else:
            mask = self.indexed_mask(split, node, mask)
        node.args = (query, a["key"], a["value"])
        node.kwargs = {**{k: v for k, v in a.items() if k not in ("query", "key", "value")},
                       "attn_mask": mask, "is_causal": False}
        split.refresh(node)
        return Local(rows)

    def in_place(self, split, node: fx.Node, op, args: tuple, rows: int) -> Local:
        """`op(*args)`'s first output (this rank's queries' attention) in place of the attention `node`."""
        with self.graph.inserting_before(node):
            call = self.graph.call_function(op, args)
            split.refresh(call)
            out = self.graph.call_function(operator.getitem, (call, 0))
            split.refresh(out)
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)
        split.states[out], split.whole[out] = Local(rows), split.whole[node]
        return Local(rows)

    def local_query(self, split, node: fx.Node):
        """The attention's arguments by name, its queries, its mask (None where it is the causal mask,
        then `is_causal`) and the queries' sequence dimension, checked to hold this rank's tokens."""
        a = self.arguments(node)
        query, mask = a["query"], a.get("attn_mask")
        rows = len(split.whole[query]) - 2
        if split.states.get(query) != Local(rows):
            raise CannotSplit(node, "its queries are not this rank's tokens laid out (batch, heads, sequence, "
                                    "head_dim)")
        return a, query, mask, rows

    def indexed_mask(self, split, node: fx.Node, mask: fx.Node) -> fx.Node:
        """A mask built from the inputs (whole on every rank), indexed to this rank's query rows and
        to the key columns in the order the ranks' keys come (rank 0's positions, then rank 1's...)."""
        if split.states.get(mask) is not None:
            raise CannotSplit(node, "its mask is computed from the split tokens; context parallelism splits a "
                                    "mask built from the inputs (positions, padding) or is_causal")
        whole = split.whole[mask]
        for at, index in ((len(whole) - 2, self.positions.kept()), (len(whole) - 1, self.positions.keys())):
            if whole[at] != 1:
                with self.graph.inserting_before(node):
                    mask = self.graph.call_function(aten.index_select.default, (mask, at, index))
                split.refresh(mask)
        return mask


class RingAttention(Attention):
    """The ring method: each attention becomes picofx::cp_ring_attention of this rank's queries and
    its own keys and values (the kv heads, before the views that repeat them, whose head order it
    checks), which the operator passes around the ring."""

    def computed_in_blocks(self, attention: fx.Node) -> bool:
        return True

    def gather(self, consumer: fx.Node, source: fx.Node, state) -> fx.Node:
        """Nothing travels here: the keys or values, marked for the attention that passes them around."""
        if state != Local(len(source.meta["val"].shape) - 2):
            raise CannotSplit(consumer, f"the keys or values {source.name} are not this rank's tokens laid out "
                                        "(batch, kv heads, sequence, head_dim)")
        with self.graph.inserting_before(consumer):
            marked = self.graph.call_function(aten.alias.default, (source,))
        consumer.replace_input_with(source, marked)
        return marked

    def rewrite(self, split, node: fx.Node) -> Local:
        a, query, mask, rows = self.local_query(split, node)
        if a.get("dropout_p", 0.0):
            raise CannotSplit(node, "it drops attention weights out, which the ring's blocks do not; set the "
                                    "attention's dropout to 0 or use ContextParallel(method=\"allgather\")")
        if mask is not None:
            mask = self.indexed_mask(split, node, mask)
        scale = a.get("scale") or query.meta["val"].shape[-1] ** -0.5
        return self.in_place(split, node, torch.ops.picofx.cp_ring_attention.default, (
            query, a["key"], a["value"], mask, scale, mask is None and a.get("is_causal", False),
            self.dim.rank, self.dim.size, self.positions.load_balance, self.dim.group_name), rows)


def check_heads_repeated(attention: fx.Node, chain: list[fx.Node], source: fx.Node) -> None:
    """The views from the kv heads to attention repeat each kv head for consecutive query heads
    (query head h reads kv head h // repeat), as the ring repeats them in each block: checked by
    running the views on head numbers."""
    heads = attention.args[0].meta["val"].shape[1]
    value = source.meta["val"]
    x = torch.arange(value.shape[1], dtype=torch.float32).view(1, -1, *[1] * (value.dim() - 2))
    x = x.expand(value.shape).contiguous()
    for view in chain:
        x = view.target(x, *view.args[1:], **view.kwargs)
    repeat = heads // value.shape[1]
    expected = (torch.arange(heads) // repeat).float().view(1, -1, *[1] * (x.dim() - 2))
    if tuple(x.shape) != tuple(attention.args[0].meta["val"].shape[:2]) + tuple(x.shape[2:]) or \
            heads % value.shape[1] or not torch.equal(x, expected.expand(x.shape)):
        raise CannotSplit(attention, f"its keys or values reach it through views ({[v.name for v in chain]}) that "
                                     "do not repeat each key head for consecutive query heads")
