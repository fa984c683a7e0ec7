"""The words picofx uses for facts about a captured graph, defined once: which ops are views, which
decoder layer a node belongs to, what kind of input a placeholder is, and the `node.meta` and
`gm.meta` keys capture writes. Every pass, analysis and tool reads them through this module.
"""
from __future__ import annotations

import re

import torch
from torch import fx

aten = torch.ops.aten

INPUT_META = "picofx_input"          # node.meta of a placeholder: its InputSlot (capture.export)
MODULE_PATH_META = "module_path"     # node.meta: the module the node came from, "model.layers.3.mlp"
SIGNATURE_META = "picofx_signature"  # gm.meta of a captured graph: its Signature
# node.meta of a float8 linear (precision): its recipe; the node is float8_linear(x, weight, recipe
# [, weight8, weight_scale]), the last two a tensorwise weight already cast (the shard pass's float8 gather)
FLOAT8_META = "picofx_float8"

# Input kinds of a placeholder's slot.
USER, PARAMETER, BUFFER, CONSTANT = "user", "parameter", "buffer", "constant"

# ATen ops whose output is a view of their first input (no data moves).
VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.permute.default, aten.t.default, aten.transpose.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.slice.Tensor, aten.select.int,
    aten.alias.default})
VIEW_PACKETS = frozenset(op.overloadpacket for op in VIEW_OPS)
# Ops that copy their input unchanged (a value read through them is the same value).
COPY_PACKETS = frozenset({aten.clone, aten.contiguous})

# A module path's repeated layer: the path up to its first numeric part ("model.layers.3").
LAYER_PATH = re.compile(r"^(.*?\.)?(\d+)(\.|$)")


def is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in VIEW_OPS


def viewed_source(node: fx.Node, through_copies: bool = False) -> fx.Node:
    """The node `node` is a view of (itself when it is none), through chains of views, and of
    unchanged copies when `through_copies`."""
    packets = VIEW_PACKETS | COPY_PACKETS if through_copies else VIEW_PACKETS
    while (node.op == "call_function" and getattr(node.target, "overloadpacket", None) in packets
           and node.args and isinstance(node.args[0], fx.Node)):
        node = node.args[0]
    return node


def input_slot(node: fx.Node):
    """A placeholder's InputSlot (kind and target), or None for other nodes and graphs picofx did
    not capture."""
    return node.meta.get(INPUT_META) if node.op == "placeholder" else None


def input_kind(node: fx.Node) -> str | None:
    """USER, PARAMETER, BUFFER or CONSTANT for a captured placeholder; None otherwise."""
    slot = input_slot(node)
    return slot.kind if slot is not None else None


def is_parameter(node: fx.Node) -> bool:
    return input_kind(node) == PARAMETER


def module_path(node: fx.Node) -> str:
    """The module the node came from ("" when unknown): capture's annotation."""
    return node.meta.get(MODULE_PATH_META) or ""


def traced_module_path(node: fx.Node) -> str:
    """The module torch's tracer recorded for a node (the innermost entry of its module stack),
    else capture's annotation. On a joint graph the recorded one is exact, where the annotation of
    a node AOT made is the path its inputs share."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    return list(stack.values())[-1][0] if stack else module_path(node)


def layer_of_path(path: str) -> str | None:
    """The repeated layer a module path lies in ("model.layers.3" for "model.layers.3.mlp.up"), or None."""
    match = LAYER_PATH.match(path or "")
    return f"{match.group(1) or ''}{match.group(2)}" if match else None


def layer_of(node: fx.Node) -> str | None:
    """The repeated layer (decoder layer) a node belongs to, or None outside the layers."""
    return layer_of_path(module_path(node))
