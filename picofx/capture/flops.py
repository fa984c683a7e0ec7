"""FLOP formulas for the ATen ops torch.utils.flop_counter does not cover yet (CPU attention).

They reuse flop_counter's own SDPA counts, so CPU and GPU graphs are counted alike.
"""
import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import register_flop_formula

aten = torch.ops.aten


def _counts_grouped_query_attention() -> bool:
    try:
        flop_counter.sdpa_flop_count((1, 2, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))
        return True
    except AssertionError:
        return False


if not _counts_grouped_query_attention():
    # Before torch 2.13 the SDPA formulas assert equal heads, and a fused graph's SDPA with
    # enable_gqa=True fails the check: count k/v as repeated to the query's heads, as the kernels do.
    _forward, _backward = flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count

    def _repeated(query_shape, shape):
        return (shape[0], query_shape[1], *shape[2:])

    flop_counter.sdpa_flop_count = lambda q, k, v: _forward(q, _repeated(q, k), _repeated(q, v))
    flop_counter.sdpa_backward_flop_count = lambda grad_out, q, k, v: _backward(
        grad_out, q, _repeated(q, k), _repeated(q, v))


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_flash_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _cpu_flash_attention_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args,
                                       out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)
