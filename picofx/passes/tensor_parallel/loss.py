"""The vocabulary-parallel cross-entropy of pass tensor_parallel: the LM head's logits stay split.

Each rank holds rows [start, start + V/tp) of the head. The loss the fuse rule recognised (a
`picofx.linear_cross_entropy` node: any of the loss forms `fuse` knows) is computed from the
local logits and three all-reduces of per-token numbers, as Megatron does:

    m   = max over ranks of the local row maxima          (tp_max; no gradient)
    s   = sum over ranks of sum(exp(logits - m))          (tp_reduce)
    t   = sum over ranks of the target's logit - m, from the rank that holds the target
    loss per token = log(s) - t;  then the mean over the tokens not ignored (or the sum)

so the whole (tokens x vocabulary) logits never exist on one rank. A vocabulary tp does not divide
is padded (zero rows past it on the last ranks, as Megatron pads); their logits are set to -inf,
so they count in neither the max nor the sum-exp and get no gradient. Autograd through these ops
gives each rank softmax - one_hot on its own columns; the hidden state's gradient, partial on each
rank, is summed by tp_copy.
"""
from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

aten = torch.ops.aten
LINEAR_CROSS_ENTROPY = torch.ops.picofx.linear_cross_entropy.default


def fused_losses(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.target is LINEAR_CROSS_ENTROPY]


def vocabulary_parallel_loss(graph: fx.Graph, fused: fx.Node, rank: int, join, vocabulary: int | None = None) -> None:
    """Replace the fused loss node `fused` (its weight already this rank's rows) by the
    vocabulary-parallel computation; `join(graph, x)` makes the node that brings the hidden state
    in (tp_copy, or the sequence-parallel all-gather); `vocabulary`: the real rows of the whole
    head (fewer than rows x ranks where it was padded)."""
    a = normalize_function(fused.target, fused.args, fused.kwargs, normalize_to_only_use_kwargs=True).kwargs
    x, weight, bias, labels = a["x"], a["weight"], a.get("bias"), a["labels"]
    rows, width = weight.meta["val"].shape
    start = rank * rows

    def op(target, *args):
        return graph.call_function(target, args)

    with graph.inserting_before(fused):
        x = join(graph, x)
        group = x.args[-1]  # the tp ranks' process group name, the join's last argument
        tokens = op(aten.reshape.default, x, [-1, width])
        flat_labels = op(aten.reshape.default, labels, [-1])
        logits = op(aten.linear.default, tokens, weight, *([bias] if bias is not None else []))
        if a.get("upcast", True):
            logits = graph.call_function(aten._to_copy.default, (logits,), {"dtype": torch.float32})
        if a.get("scale", 1.0) != 1.0:
            logits = op(aten.div.Tensor, logits, a["scale"])
        if a.get("softcap", 0.0) > 0:
            logits = op(aten.mul.Tensor, op(aten.tanh.default, op(aten.div.Tensor, logits, a["softcap"])),
                        a["softcap"])
        real = rows if vocabulary is None else max(0, min(vocabulary - start, rows))
        if real < rows:  # padded rows: their logits never win
            columns = graph.call_function(aten.arange.default, (rows,), {"device": weight.meta["val"].device})
            logits = op(aten.where.ScalarOther, op(aten.lt.Scalar, columns, real), logits, float("-inf"))
        local_max = op(aten.amax.default, op(aten.detach.default, logits), [-1], True)
        shifted = op(aten.sub.Tensor, logits, op(torch.ops.picofx.tp_max.default, local_max, group))
        sum_exp = op(torch.ops.picofx.tp_reduce.default, op(aten.sum.dim_IntList, op(aten.exp.default, shifted), [-1]),
                     group)
        local = op(aten.sub.Tensor, flat_labels, start)
        inside = op(aten.logical_and.default, op(aten.ge.Scalar, local, 0), op(aten.lt.Scalar, local, rows))
        index = op(aten.unsqueeze.default, op(aten.where.ScalarOther, inside, local, 0), -1)
        picked = op(aten.squeeze.dim, op(aten.gather.default, shifted, -1, index), -1)
        target = op(torch.ops.picofx.tp_reduce.default, op(aten.where.ScalarOther, inside, picked, 0.0), group)
        per_token = op(aten.sub.Tensor, op(aten.log.default, sum_exp), target)
        valid = op(aten.ne.Scalar, flat_labels, a.get("ignore_index", -100))
        loss = op(aten.sum.default, op(aten.where.ScalarOther, valid, per_token, 0.0))
        if a.get("reduction", "mean") == "mean":
            loss = op(aten.div.Tensor, loss, op(aten.sum.default, valid))
    for user in list(fused.users):
        if user.target is operator.getitem and user.args[1] == 0:
            user.replace_all_uses_with(loss)
        graph.erase_node(user)
    graph.erase_node(fused)
