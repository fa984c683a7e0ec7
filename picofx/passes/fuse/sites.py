"""Where the fuse rules could apply: a census of a graph's fusible sites, by kind, and of the
fused ops that took their place. The fuse pass uses it to name, with explain=True, every site
that did not fuse (tools/fusion_coverage.py to measure coverage per model).

Kinds and what counts as one unfused site:
  norm       an RMSNorm: rsqrt(mean(x**2) + eps), or ATen's own rms_norm ops
  gated_mlp  act(gate) * up with act silu (or x * sigmoid(x)) or GeLU
  rope       the rotation of q and k in one module (rotate-half: neg of a slice fed to cat, or
             to stack for interleaved pairs; complex: view_as_complex of a value that depends on
             a parameter)
  attention  softmax over scores that a matmul then applies to values, or SDPA over k/v
             heads repeated for grouped-query attention
  loss       log_softmax over a projection's output (through views, casts, a scale, a soft-cap)
A site is fusible unless `reason` says why not (soft-capped attention scores: SDPA has no soft-cap;
a loss with label smoothing, class weights or per-token weights: the fused loss computes none).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from operator import getitem

import torch
from torch import fx

from picofx.capture.vocabulary import input_slot, module_path

aten = torch.ops.aten
KINDS = ("norm", "gated_mlp", "rope", "attention", "loss")
# torch.ops.picofx op name -> the kind of site it fuses
FUSED_OPS = {"rms_norm": "norm", "add_rms_norm": "norm", "silu_mul": "gated_mlp", "gelu_mul": "gated_mlp",
             "rope": "rope", "linear_cross_entropy": "loss"}
# ops a value passes through unchanged in meaning: views, copies, casts
PASS_THROUGH = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                aten._to_copy.default, aten.alias.default, aten.expand.default, aten.contiguous.default,
                aten.squeeze.dims, aten.unsqueeze.default, aten.permute.default, aten.t.default}
ROPE_RATIO = 2  # tensors rotated per site: q and k
# what rotate_half joins its negated half with: cat (halves), stack (pairs; in ATen: unsqueeze, cat)
ROTATE_JOINS = (aten.cat.default, aten.stack.default)
# from the label's log-probability to its token's loss: -log_probs.gather(labels), 0 where ignored
LOSS_PER_TOKEN = {aten.squeeze.dims, aten.squeeze.dim, aten.neg.default, aten.where.self}


@dataclass(frozen=True)
class Site:
    kind: str
    node: str            # the node that marks the site
    module_path: str
    looks_like: str      # what the unfused code is, in ATen terms
    reason: str | None = None  # why no rule may fuse it; None: fusible

    @property
    def fusible(self) -> bool:
        return self.reason is None


def _target(node) -> object:
    return node.target if isinstance(node, fx.Node) and node.op == "call_function" else None


def _through(node: fx.Node, extra=()) -> fx.Node:
    """The node's source through PASS_THROUGH ops (and `extra` unary ops)."""
    while _target(node) in PASS_THROUGH or _target(node) in extra:
        node = node.args[0]
    return node


def _uncast(node):
    while _target(node) is aten._to_copy.default:
        node = node.args[0]
    return node


def _is_activation(node) -> bool:
    """silu, gelu, or x * sigmoid(x), maybe computed in fp32 between casts (bf16 models)."""
    node = _uncast(node)
    t = _target(node)
    if t in (aten.silu.default, aten.gelu.default):
        return True
    if t is aten.mul.Tensor and len(node.args) == 2:
        a, b = node.args
        return any(_target(s) is aten.sigmoid.default and _uncast(s.args[0]) is _uncast(o) for s, o in ((a, b), (b, a)))
    return False


def _activation_input(node: fx.Node) -> fx.Node:
    node = _uncast(node)
    if _target(node) is aten.mul.Tensor:
        return _uncast(node.args[0] if _target(node.args[1]) is aten.sigmoid.default else node.args[1])
    return _uncast(node.args[0])


def rotated_half(node) -> bool:
    """node is rotate_half(x) * sin of a written-out RoPE: a product with cat(-x2, x1) (or the
    pairs stacked)."""
    if _target(node) is not aten.mul.Tensor:
        return False
    for factor in node.args:
        if _target(factor) in ROTATE_JOINS and isinstance(factor.args[0], (list, tuple)):
            first = factor.args[0][0]
            while _target(first) is aten.unsqueeze.default:
                first = first.args[0]
            if _target(first) is aten.neg.default:
                return True
    return False


def _parameter_dependent(graph: fx.Graph) -> set[fx.Node]:
    dependent = set()
    for node in graph.nodes:
        slot = input_slot(node)
        if node.op == "placeholder" and slot is not None and slot.kind == "parameter":
            dependent.add(node)
        elif node.op == "call_function" and any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _through_users(node: fx.Node, ops) -> fx.Node:
    """The first node down node's single-user chain that is not one of `ops`."""
    while _target(node) in ops and len(node.users) == 1:
        node = next(iter(node.users))
    return node


def _reaches_matmul(node: fx.Node, depth: int = 6) -> bool:
    if depth == 0:
        return False
    for user in node.users:
        if _target(user) in (aten.bmm.default, aten.matmul.default, aten.mm.default):
            return True
        if _target(user) in PASS_THROUGH or _target(user) is aten.dropout.default or user.op == "call_function" \
                and "dropout" in str(user.target):
            if _reaches_matmul(user, depth - 1):
                return True
    return False


def _soft_capped(node: fx.Node, depth: int = 4) -> bool:
    """tanh among the few ops before `node` (scores soft-capped as tanh(s / c) * c)."""
    frontier = [node]
    for _ in range(depth):
        frontier = [a for n in frontier for a in n.all_input_nodes]
        if any(_target(a) is aten.tanh.default for a in frontier):
            return True
    return False


def _repeated_heads(node: fx.Node) -> bool:
    """k (or v) made of heads repeated: x[:, :, None].expand(...).reshape(...), or repeat_interleave."""
    source = node
    while _target(source) in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                              aten.permute.default, aten.alias.default):
        source = source.args[0]
    if _target(source) is aten.repeat_interleave.self_int:
        return True
    return _target(source) is aten.expand.default and _target(source.args[0]) is aten.unsqueeze.default


def _loss_not_fusible(log_probs: fx.Node) -> str | None:
    """Why the cross-entropy over these log-probabilities is not the fused loss's: the mean or sum
    over tokens of -log_probs[label], every token and every vocabulary entry weighed alike."""
    users = {_target(u) for u in log_probs.users}
    if aten.mul.Tensor in users:
        return "class weights: the loss weighs each vocabulary entry, the fused op weighs all alike"
    if users - {aten.gather.default}:
        return ("label smoothing: the loss also sums the log-probabilities over the vocabulary, "
                "the fused op takes the label's alone")
    per_token = next(iter(log_probs.users))
    while len(per_token.users) == 1 and _target(next(iter(per_token.users))) in LOSS_PER_TOKEN:
        per_token = next(iter(per_token.users))
    if any(_target(u) is not aten.sum.dim_IntList or u.args[1:2] not in ((), ([],), (None,)) for u in per_token.users):
        return ("per-token losses (reduction='none') are weighed or kept before the reduction; "
                "the fused op returns only their mean or sum")
    return None


def find_sites(graph: fx.Graph) -> list[Site]:
    """The unfused sites of the graph, in graph order."""
    sites, dependent = [], _parameter_dependent(graph)
    rotations: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        t, path = _target(node), module_path(node)
        if t is None:
            continue
        site = lambda kind, looks, reason=None: sites.append(Site(kind, node.name, path, looks, reason))  # noqa: E731
        if t is aten.rsqrt.default and _target(_through(node.args[0], (aten.add.Tensor, aten.add.Scalar))) \
                is aten.mean.dim:
            site("norm", "x * rsqrt(mean(x**2) + eps) * weight, written out")
        elif t in (getattr(aten, "rms_norm", None) and aten.rms_norm.default,
                   getattr(aten, "_fused_rms_norm", None) and aten._fused_rms_norm.default):
            site("norm", f"the norm is {t}")
        elif t is aten.mul.Tensor and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
            for act, other in (node.args, node.args[::-1]):
                if _is_activation(act) and _uncast(other) is not _activation_input(act) and not _is_activation(node):
                    site("gated_mlp", f"{act.target}(gate) * up")
                    break
        elif t is aten.neg.default and node in dependent and _target(node.args[0]) in (aten.slice.Tensor, getitem) \
                and any(_target(_through_users(u, (aten.unsqueeze.default,))) in ROTATE_JOINS for u in node.users):
            rotations.setdefault(path, []).append(node)
        elif t is aten.view_as_complex.default and node in dependent:
            rotations.setdefault(path, []).append(node)
        elif t is aten._softmax.default and _reaches_matmul(node):
            reason = "the scores are soft-capped (tanh): SDPA has no soft-cap" if _soft_capped(node) else None
            site("attention", "softmax(q @ k^T) @ v, written out", reason)
        elif t is aten.scaled_dot_product_attention.default and not node.kwargs.get("enable_gqa") \
                and _repeated_heads(node.args[1]):
            site("attention", "SDPA over k and v heads repeated to the query heads")
        elif t is aten._log_softmax.default:
            source = _through(node.args[0], (aten.div.Tensor, aten.mul.Tensor, aten.tanh.default))
            if _target(source) is aten.linear.default:
                site("loss", "cross_entropy(linear(x)) with the logits written out", _loss_not_fusible(node))
    for path, nodes in rotations.items():
        for first in nodes[::ROPE_RATIO]:
            kind = "complex" if _target(first) is aten.view_as_complex.default else "rotate-half"
            sites.append(Site("rope", first.name, path, f"{kind} RoPE, written out"))
    return sites


def fused_counts(graph: fx.Graph) -> Counter:
    """Fused ops by the kind of site they replaced (SDPA with grouped-query heads as attention)."""
    counts = Counter()
    for node in graph.nodes:
        packet = getattr(_target(node), "overloadpacket", None)
        name = getattr(packet, "_qualified_op_name", "")
        if name.startswith("picofx::") and name[8:] in FUSED_OPS:
            counts[FUSED_OPS[name[8:]]] += 1
        elif _target(node) is aten.scaled_dot_product_attention.default and node.kwargs.get("enable_gqa"):
            counts["attention"] += 1
    return counts


def census(graph: fx.Graph) -> dict[str, dict[str, int]]:
    """{kind: {"fused": n, "unfused": fusible sites left, "not_fusible": sites no rule may fuse}}."""
    sites, fused = find_sites(graph), fused_counts(graph)
    return {kind: {"fused": fused[kind],
                   "unfused": sum(s.kind == kind and s.fusible for s in sites),
                   "not_fusible": sum(s.kind == kind and not s.fusible for s in sites)} for kind in KINDS}


def accounting(before: dict, after: dict) -> dict[str, dict[str, int]]:
    """Per kind, from the census before and after `fuse`: sites found, fused (fusible sites gone),
    unfused (fusible sites still there: no rule matched, or a check rejected them) and
    not_fusible (sites no rule may fuse, left alone for a reason)."""
    return {kind: {"found": before[kind]["unfused"] + before[kind]["not_fusible"],
                   "fused": before[kind]["unfused"] - after[kind]["unfused"],
                   "unfused": after[kind]["unfused"], "not_fusible": after[kind]["not_fusible"]}
            for kind in KINDS}
