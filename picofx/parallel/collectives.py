"""Megatron's two tensor-parallel operators as custom ops with autograd, over a named process group.

    picofx::tp_reduce(x, group)  forward: the sum over the group's ranks; backward: the gradient as is
    picofx::tp_copy(x, group)    forward: x as is; backward: the sum of the gradient over the ranks

A row-parallel linear's partial output goes through tp_reduce; a column-parallel linear's input
(the same on every rank) through tp_copy, so that its gradient, partial on each rank, is summed.
Each runs torch's functional all-reduce (`_c10d_functional`), so it works with gloo and NCCL.
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
