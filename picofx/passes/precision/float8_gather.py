"""Sequence parallelism's all-gather in float8 (tensorwise recipe), as torchao's float8 tensor parallelism.

Under TensorParallel(sequence_parallel=True) the column-parallel linears of a block read one
all-gather of the residual stream's sequence shards (sp_gather, then the compute dtype's cast).
When every reader is a tensorwise float8 linear, each rank instead casts its shard to e4m3 with
the scale of the whole gathered tensor (its amax the maximum over the tp ranks) and gathers the
float8 bytes: a quarter of fp32's, half of bf16's. The values equal the cast of the gathered
tensor bit for bit, so the linears compute what they computed before.

    outs = float8_gathered_linears(shard, dtype, dim, ranks, group, w_1, ..., w_n)
         == [float8_linear(sp_gather(shard).to(dtype), w_i, "tensorwise", "colwise", group)]

The backward multiplies with the gathered float8 activation saved from the forward (the weight
gradients) and reduce-scatters the summed input gradient in the shard's dtype, as sp_gather's
backward does. Rowwise recipes scale per row of the gathered tensor after it is whole: they gather
in high precision.
"""
from __future__ import annotations

import operator

import torch
from torch import Tensor, fx

from picofx.passes.precision.casts import is_plain_cast
from picofx.passes.precision.float8_linear import (E4M3, E5M2, RECIPES, SPLIT_OPERANDS, float8_linear, float8_scale,
                                                   scaled_matmul, to_float8)

c10d = torch.ops._c10d_functional


def gather_bytes(t: Tensor, dim: int, ranks: int, group: str) -> Tensor:
    """The all-gather along `dim` of a float8 tensor, sent as its bytes (gloo and NCCL take uint8)."""
    sent = t.view(torch.uint8).movedim(dim, 0).contiguous()
    parts = c10d.wait_tensor(c10d.all_gather_into_tensor(sent, ranks, group))
    return parts.movedim(0, dim).contiguous().view(t.dtype)


def reduce_scatter(t: Tensor, dim: int, ranks: int, group: str) -> Tensor:
    part = c10d.wait_tensor(c10d.reduce_scatter_tensor(t.movedim(dim, 0).contiguous(), "sum", ranks, group))
    return part.movedim(0, dim).contiguous()


def weight_cast(w: Tensor, group: str) -> tuple[Tensor, Tensor]:
    """A colwise piece (N/tp, K) in e4m3 with the whole weight's scale, and that scale."""
    w_scale = float8_scale(w, E4M3, None, False, split_dim=0, group=group)
    return to_float8(w, w_scale, E4M3), w_scale                             # w8.t(): column-major


def cast_or_given(w: Tensor, given: tuple, group: str) -> tuple[Tensor, Tensor]:
    """The weight's e4m3 cast and scale: the pair Shard gathered ahead, else cast here."""
    return given if given[0] is not None else weight_cast(w, group)


class Float8GatheredLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: Tensor, dtype: torch.dtype, dim: int, ranks: int, group: str, given: tuple,
                *weights: Tensor):
        x_shard = shard.to(dtype)                                             # (B, T/tp, K)
        scale = float8_scale(x_shard, E4M3, None, False, split_dim=dim, group=group)
        # The weights' scales come from one all-reduce at the graph's start (picofx.parallel.maxima), so
        # their casts run while the shard's amax travels (the first) and while the rows do (the others).
        casts = [cast_or_given(weights[0], given[0], group)]
        x8 = gather_bytes(to_float8(x_shard, scale, E4M3), dim, ranks, group)  # (B, T, K) in e4m3
        x2 = x8.reshape(-1, x8.shape[-1])                                     # (M, K)
        casts += [cast_or_given(w, pair, group) for w, pair in zip(weights[1:], given[1:])]
        outs, kept = [], []
        for w, (w8, w_scale), (given8, _) in zip(weights, casts, given):     # (N/tp, K): colwise pieces
            kept += [w] if given8 is None else [w8, w_scale]  # a weight cast ahead: its cast, not its values
            out = torch._scaled_mm(x2, w8.t(), scale_a=scale.reciprocal(), scale_b=w_scale.reciprocal(),
                                   out_dtype=dtype, use_fast_accum=True)
            outs.append(out.reshape(*x8.shape[:-1], w.shape[0]))
        ctx.given, ctx.weight_dtypes = [pair[0] is not None for pair in given], [w.dtype for w in weights]
        ctx.save_for_backward(x8, scale, *kept)
        ctx.layout = (shard.dtype, dim, ranks, group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        x8, scale, *saved = ctx.saved_tensors
        shard_dtype, dim, ranks, group = ctx.layout
        recipe, splits = RECIPES["tensorwise"], SPLIT_OPERANDS["colwise"]
        x2 = x8.reshape(-1, x8.shape[-1])                                     # (M, K)
        grad_x, grad_weights = None, []
        for grad, cast_ahead, weight_dtype in zip(grads, ctx.given, ctx.weight_dtypes):
            w, b_float8 = saved[0], (tuple(saved[:2]) if cast_ahead else None)
            saved = saved[1 + cast_ahead:]
            grad2 = grad.reshape(-1, grad.shape[-1])                          # (M, N/tp)
            partial = scaled_matmul(grad2, w, recipe.grad_input, False, False, splits["grad_input"], group,
                                    b_float8=b_float8)
            grad_x = partial if grad_x is None else grad_x + partial
            g_scale = float8_scale(grad2.t(), E5M2, None, False, split_dim=0, group=group)
            g8 = to_float8(grad2.t(), g_scale, E5M2).contiguous()            # (N/tp, M)
            grad_w = torch._scaled_mm(g8, x2.t().contiguous().t(), scale_a=g_scale.reciprocal(),
                                      scale_b=scale.reciprocal(), out_dtype=grad.dtype, use_fast_accum=False)
            grad_weights.append(grad_w.to(weight_dtype))                      # (N/tp, K)
        grad_shard = reduce_scatter(grad_x.reshape(x8.shape).to(shard_dtype), dim, ranks, group)
        return (grad_shard, None, None, None, None, None, *grad_weights)


def float8_gathered_linears(shard: Tensor, dtype: torch.dtype, dim: int, ranks: int, group: str,
                            *weights: Tensor, weights8: tuple = (), weight_scales: tuple = ()) -> tuple[Tensor, ...]:
    """weights8, weight_scales: per weight, its e4m3 cast and scale made ahead (the shard pass gathers
    them), or None; where given, the weight's values are not read, only its gradient taken."""
    given = tuple(zip(weights8, weight_scales)) or ((None, None),) * len(weights)
    return Float8GatheredLinears.apply(shard, dtype, dim, ranks, group, given, *weights)


def gather_in_float8(gm: fx.GraphModule, recipe: str) -> int:
    """Replace each sequence-parallel all-gather whose readers are all tensorwise float8 colwise
    linears by one float8_gathered_linears; returns how many gathers now move float8."""
    if recipe != "tensorwise":
        return 0
    done = 0
    for gather in [n for n in gm.graph.nodes if n.target is torch.ops.picofx.sp_gather.default]:
        cast = next(iter(gather.users)) if len(gather.users) == 1 else None
        x = cast if cast is not None and is_plain_cast(cast) else gather
        readers = list(x.users)
        if not readers or any(r.target is not float8_linear or len(r.args) != 5 or r.args[0] is not x
                              or r.args[3] != "colwise" for r in readers):
            continue
        shard, dim, ranks, group = gather.args
        first = next(n for n in gm.graph.nodes if n in readers)
        with gm.graph.inserting_before(first):
            call = gm.graph.call_function(float8_gathered_linears, (shard, x.meta["val"].dtype, dim, ranks, group,
                                                                    *(r.args[1] for r in readers)))
            outs = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(readers))]
        call.meta.update({k: v for k, v in first.meta.items() if k != "val"})
        call.meta["val"] = tuple(r.meta["val"] for r in readers)
        for out, reader in zip(outs, readers):
            out.meta.update(reader.meta)
            reader.replace_all_uses_with(out)
            gm.graph.erase_node(reader)
        for node in (x, gather) if x is not gather else (gather,):
            if not node.users:
                gm.graph.erase_node(node)
        done += 1
    gm.recompile()
    return done
