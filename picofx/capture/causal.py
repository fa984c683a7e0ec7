"""Attention masks proven causal on the captured graph, for the passes that then run attention with
`is_causal` and no mask (fuse, context_parallel).

The rule: a mask is causal when it is computed from constants alone and, evaluated once here on
the whole sequence, lets each query attend to exactly the keys at or before it. Hugging Face builds
such a mask from position ranges when the model is called without an `attention_mask`; a model may
also add a constant tril of -inf (Meta's reference) or compare aranges itself. A mask that reads
any input of the graph is never taken as causal, whatever that input holds when captured: a user's
`attention_mask` (padding) or `position_ids` (packed sequences), and a buffer too (the model's, so
it may change between steps). Such a mask stays, and attention runs masked.
"""
from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from picofx.capture.vocabulary import is_view

MASK_EVALUATED_UP_TO = 2**26  # entries: a mask proven causal by evaluating it at capture (a 8192^2 one)


def input_read(mask: fx.Node) -> fx.Node | None:
    """A node that `mask` is computed from that is no constant: an input of the graph, a random op,
    or an op that writes in place into what the mask reads (captured graphs have none); None when
    every node it reads is a pure call or a constant attribute."""
    seen, pending = set(), [mask]
    while pending:
        node = pending.pop()
        if node in seen or node.op == "get_attr":
            continue
        if node.op != "call_function" or node.is_impure():
            return node
        seen.add(node)
        pending.extend(node.all_input_nodes)
        pending.extend(writes_in_place(node))
    return None


def writes_in_place(node: fx.Node) -> list[fx.Node]:
    """The ops that write in place into `node`'s value, directly or through views of it."""
    found, views = [], [node]
    while views:
        for user in views.pop().users:
            if is_view(user):
                views.append(user)
            elif isinstance(user.target, torch._ops.OpOverload) and user.target._schema.is_mutable:
                found.append(user)
    return found


def computed_by(mask: fx.Node) -> list[fx.Node]:
    """The nodes that compute `mask`, itself included, in graph order."""
    needed, pending = set(), [mask]
    while pending:
        node = pending.pop()
        if node not in needed:
            needed.add(node)
            pending.extend(node.all_input_nodes)
    return [n for n in mask.graph.nodes if n in needed]


def evaluated(nodes: list[fx.Node]) -> dict[fx.Node, object]:
    """The nodes' values, computed in graph order."""
    values = {}
    for node in nodes:
        if node.op == "get_attr":
            values[node] = getattr(node.graph.owning_module, node.target)
        else:
            args, kwargs = fx.map_arg((node.args, node.kwargs), values.__getitem__)
            values[node] = node.target(*args, **kwargs)
    return values


def is_causal_mask(mask: fx.Node) -> bool:
    """Whether `mask` (boolean: True attends; or additive: 0 attends, -inf or below half the dtype's
    lowest number does not) is computed from constants alone and is the causal mask: each query
    attends to exactly the keys at or before it, in every batch entry and head."""
    return why_not_causal(mask) is None


def why_not_causal(mask: fx.Node) -> str | None:
    """None when `mask` is proven causal (is_causal_mask), else the reason it is not."""
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return f"{mask.name} has no recorded tensor value"
    if val.numel() > MASK_EVALUATED_UP_TO:
        return f"{mask.name} has {val.numel()} entries, more than the {MASK_EVALUATED_UP_TO} evaluated at capture"
    source = input_read(mask)
    if source is not None:
        what = "the random or in-place op" if source.op == "call_function" else "the graph's input"
        return (f"{mask.name} is computed from {what} {source.name}, which may hold anything at run time "
                "(a padding attention_mask, packed positions, a buffer): attention stays masked")
    try:
        with unset_fake_temporarily(), torch.no_grad():  # real tensors, also where a fake mode is active
            value = evaluated(computed_by(mask))[mask]
            causal = isinstance(value, torch.Tensor) and _is_causal(value)
    except Exception as error:  # noqa: BLE001  (what cannot be evaluated here is not proven causal)
        return f"{mask.name} could not be evaluated at capture: {type(error).__name__}: {error}"
    return None if causal else f"{mask.name} is not the causal tril (a window, another triangle, padding...)"


def _is_causal(value: torch.Tensor) -> bool:
    if value.dim() < 2 or value.shape[-1] != value.shape[-2]:
        return False
    if value.dtype == torch.bool:
        allowed = value
    else:
        allowed = value == 0
        if not bool((allowed | (value <= torch.finfo(value.dtype).min / 2)).all()):
            return False
    causal = torch.ones(value.shape[-2:], dtype=torch.bool, device=value.device).tril()
    return bool((allowed == causal).all())


def erase_unread(graph: fx.Graph, nodes) -> int:
    """Erase those of `nodes` that nothing reads any more (a mask no attention takes now), and what
    only they read; inputs and impure calls stay. Returns how many nodes it erased."""
    pending, erased = list(nodes), set()
    while pending:
        node = pending.pop()
        if node in erased or node.users or node.op not in ("call_function", "get_attr") or node.is_impure():
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        pending.extend(inputs)
    return len(erased)
