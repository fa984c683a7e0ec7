"""Megatron's two tensor-parallel operators as custom ops with autograd, over a named process group.

    picofx::tp_reduce(x, group)  forward: the sum over the group's ranks; backward: the gradient as is
    picofx::tp_copy(x, group)    forward: x as is; backward: the sum of the gradient over the ranks

A row-parallel linear's partial output goes through tp_reduce; a column-parallel linear's input
(the same on every rank) through tp_copy, so that its gradient, partial on each rank, is summed.
Each runs torch's functional all-reduce (`_c10d_functional`), so it works with gloo and NCCL.

In a captured step these operators are what autograd differentiates; pass tensor_parallel then
rewrites each, in the forward and backward graphs that run, into the functional collective it
calls here, with the issue and the wait as separate nodes (picofx.parallel.lower).
Run as they are (an interpreter over the captured graph), each issues and waits at once.
"""
from __future__ import annotations

import torch

c10d = torch.ops._c10d_functional


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "sum", group))


@torch.library.custom_op("picofx::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return _all_reduce(x, group)


@tp_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)


@torch.library.custom_op("picofx::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    return x.clone()


@tp_copy.register_fake
def _(x, group):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.group = inputs[1]


def _reduce_backward(ctx, grad):
    return grad, None


def _copy_backward(ctx, grad):
    return tp_reduce(grad, ctx.group), None


tp_reduce.register_autograd(_reduce_backward, setup_context=_setup)
tp_copy.register_autograd(_copy_backward, setup_context=_setup)


@torch.library.custom_op("picofx::tp_max", mutates_args=())
def tp_max(x: torch.Tensor, group: str) -> torch.Tensor:
    """The elementwise maximum over the group's ranks (no gradient: for softmax statistics)."""
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "max", group))


@tp_max.register_fake
def _(x, group):
    return torch.empty_like(x)


# Megatron's sequence parallelism: the residual stream (norms, residual adds) runs on sequence shards.
#   picofx::sp_gather(x, dim, ranks, group)   forward: all-gather along `dim`; backward: reduce-scatter (sum)
#   picofx::sp_scatter(x, dim, ranks, group)  forward: reduce-scatter (sum) along `dim`; backward: all-gather


def _gather(x: torch.Tensor, dim: int, ranks: int, group: str) -> torch.Tensor:
    parts = c10d.wait_tensor(c10d.all_gather_into_tensor(x.movedim(dim, 0).contiguous(), ranks, group))
    return parts.movedim(0, dim).contiguous()


def _scatter(x: torch.Tensor, dim: int, ranks: int, group: str) -> torch.Tensor:
    part = c10d.wait_tensor(c10d.reduce_scatter_tensor(x.movedim(dim, 0).contiguous(), "sum", ranks, group))
    return part.movedim(0, dim).contiguous()


def _resized(x: torch.Tensor, dim: int, factor: float) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = int(shape[dim] * factor)
    return x.new_empty(shape)


@torch.library.custom_op("picofx::sp_gather", mutates_args=())
def sp_gather(x: torch.Tensor, dim: int, ranks: int, group: str) -> torch.Tensor:
    return _gather(x, dim, ranks, group)


@sp_gather.register_fake
def _(x, dim, ranks, group):
    return _resized(x, dim, ranks)


@torch.library.custom_op("picofx::sp_scatter", mutates_args=())
def sp_scatter(x: torch.Tensor, dim: int, ranks: int, group: str) -> torch.Tensor:
    return _scatter(x, dim, ranks, group)


@sp_scatter.register_fake
def _(x, dim, ranks, group):
    return _resized(x, dim, 1 / ranks)


def _setup_sequence(ctx, inputs, output):
    ctx.dim, ctx.ranks, ctx.group = inputs[1], inputs[2], inputs[3]


sp_gather.register_autograd(lambda ctx, grad: (sp_scatter(grad, ctx.dim, ctx.ranks, ctx.group), None, None, None),
                            setup_context=_setup_sequence)
sp_scatter.register_autograd(lambda ctx, grad: (sp_gather(grad, ctx.dim, ctx.ranks, ctx.group), None, None, None),
                             setup_context=_setup_sequence)
