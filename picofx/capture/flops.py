"""FLOP formulas for the ATen ops torch.utils.flop_counter does not cover yet (CPU attention).

They reuse flop_counter's own SDPA counts, so CPU and GPU graphs are counted alike.
"""
import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_flash_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _cpu_flash_attention_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args,
                                       out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)
