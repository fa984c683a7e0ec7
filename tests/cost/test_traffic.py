"""picofx.cost.inductor.traffic: bytes each kernel moves as Inductor runs a graph."""
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import picofx.kernels  # noqa: F401  (registers torch.ops.picofx)
from picofx.cost.inductor.opaque_traffic import opaque_traffic
from picofx.cost.inductor.traffic import graph_traffic, traffic_by_label

N = 256 * 1024  # elements: far above Inductor's fusion thresholds


def traced(fn, *shapes) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*[torch.empty(s) for s in shapes])


def test_a_pointwise_chain_is_one_kernel_reading_its_input_once_and_writing_its_result():
    kernels = graph_traffic(traced(lambda x: (x * 2 + 1).relu(), (N,)))
    assert [(k.read, k.written) for k in kernels] == [(4 * N, 4 * N)]


def test_a_matmul_between_pointwise_ops_splits_them_and_its_output_is_written_and_read_back():
    gm = traced(lambda x, w: (x.sin() @ w).cos(), (512, 512), (512, 512))
    kernels = graph_traffic(gm)
    size = 512 * 512 * 4
    assert [(k.read, k.written) for k in kernels] == [(size, size), (2 * size, size), (size, size)]


def test_a_value_two_kernels_need_is_written_once_and_read_by_each():
    gm = traced(lambda x, w: (x.exp() @ w, x.exp().sum()), (512, 512), (512, 512))
    moved = sum(k.moved for k in graph_traffic(gm))
    size = 512 * 512 * 4
    # exp: read x, write e (the sum fuses with it: reads nothing more); mm: read e and w, write out
    assert moved == (size + size) + (3 * size) + 4


def test_bytes_split_by_label_and_add_up_to_the_kernels():
    gm = traced(lambda x, w: (x.sin() @ w).cos(), (512, 512), (512, 512))
    label = lambda node: "matmul" if node.target is torch.ops.aten.mm.default else "pointwise"  # noqa: E731
    totals = traffic_by_label([gm], label)
    assert totals["matmul"]["kernels"] == 1 and totals["pointwise"]["kernels"] == 2
    assert sum(t["read"] + t["written"] for t in totals.values()) == sum(k.moved for k in graph_traffic(gm))


def test_the_chunked_loss_rereads_the_weight_and_its_gradient_once_per_chunk():
    tokens, hidden, vocab = 1024, 64, 4096
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta")
    w = torch.empty(vocab, hidden, dtype=torch.bfloat16, device="meta")
    labels = torch.empty(tokens, dtype=torch.long, device="meta")
    op = torch.ops.picofx.linear_cross_entropy.default
    two, four, eight = (opaque_traffic(op, (x, w, None, labels, -100, "mean", True, tokens // n, True, 1.0, 0.0), {})
                        for n in (2, 4, 8))
    assert two.kernels < four.kernels < eight.kernels
    weight, accumulator = vocab * hidden * 2, vocab * hidden * 4
    # each further chunk reads the bf16 weight in two matmuls (logits, grad_x) and adds its weight
    # gradient into the fp32 sum in place (read, write); the logits and activations move the same in
    # total, and no bf16 (vocab x hidden) product is written
    extra = 2 * weight + 2 * accumulator
    assert (four.read + four.written) - (two.read + two.written) == 2 * extra
    assert (eight.read + eight.written) - (four.read + four.written) == 4 * extra
