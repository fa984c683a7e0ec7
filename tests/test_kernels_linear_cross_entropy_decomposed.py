"""The fused loss in ATen ops for Inductor (linear_cross_entropy_decomposed), through aot_autograd as
the compile path runs it: loss and gradients equal F.cross_entropy (fp32 rtol 1e-5) for mean and
sum, ignore_index, scale, soft-cap and bias; its graphs hold no picofx op, only ATen, with the
chunks unrolled; and the table entry keeps the op's kernel, one call, on CPU, where it is faster."""
import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_function, make_boxed_func
from torch.fx.experimental.proxy_tensor import make_fx

import picofx.kernels
from picofx.kernels.linear_cross_entropy import linear_cross_entropy_decomposed, linear_cross_entropy_decomposition

OP, KERNEL = torch.ops.picofx.linear_cross_entropy.default, torch.ops.picofx.linear_cross_entropy_kernel.default
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
IGNORE = -7
# reduction, bias, scale, soft-cap, tokens a chunk (of 27: 4 chunks, or one)
FORMS = {"mean": ("mean", False, 1.0, 0.0, 7), "sum_one_chunk": ("sum", False, 1.0, 0.0, 100),
         "bias": ("mean", True, 1.0, 0.0, 7), "sum_bias_scale": ("sum", True, 3.0, 0.0, 7),
         "softcap_one_chunk": ("mean", False, 1.0, 5.0, 100), "bias_scale_softcap": ("mean", True, 2.0, 4.0, 7)}


def inputs(bias, n_tokens=27, hidden=16, vocab=50):
    torch.manual_seed(0)
    x = torch.randn(3, n_tokens // 3, hidden, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, hidden)).requires_grad_()
    b = torch.randn(vocab, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (3, n_tokens // 3))
    labels.view(-1)[::3] = IGNORE
    return [t for t in (x, weight, b) if t is not None], labels


def reference(x, weight, bias, labels, reduction, scale, softcap):
    scores = F.linear(x, weight, bias).float() / scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return F.cross_entropy(scores.flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction=reduction)


def decomposed_loss(reduction, scale, softcap, chunk, graphs):
    def loss(labels, x, weight, bias=None):
        return OP(x, weight, bias, labels, IGNORE, reduction, True, chunk, True, scale, softcap)[0]

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)
    return aot_function(loss, fw_compiler=keep, bw_compiler=keep, decompositions={OP: linear_cross_entropy_decomposed})


@pytest.mark.parametrize("form", FORMS)
def test_decomposed_loss_equals_cross_entropy(form):
    reduction, bias, scale, softcap, chunk = FORMS[form]
    tensors, labels = inputs(bias)
    expected = reference(*tensors[:2], tensors[2] if bias else None, labels, reduction, scale, softcap)
    expected_grads = torch.autograd.grad(expected, tensors)
    graphs = []
    loss = decomposed_loss(reduction, scale, softcap, chunk, graphs)(labels, *tensors)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for grad, want in zip(torch.autograd.grad(loss, tensors), expected_grads):
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
    forward, backward = graphs
    targets = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if getattr(t, "namespace", None) == "picofx"]  # no opaque op left
    chunks = -(-27 // chunk)
    assert sum(n.target in MATMULS for n in forward.graph.nodes) == 3 * chunks  # logits, grad_x, grad_weight
    assert sum(n.target in MATMULS for n in backward.graph.nodes) == 0  # it only scales the saved sums


def traced_entry(device):
    (x, weight), labels = inputs(bias=False)
    args = [t.detach().to(device) for t in (x, weight)]
    fn = make_fx(lambda x, w, labels: OP(x, w, None, labels, IGNORE, "mean", True, 7, True, 1.0, 0.0),
                 decomposition_table=picofx.kernels.inductor_decompositions())
    return [n.target for n in fn(*args, labels.to(device)).graph.nodes if n.op == "call_function"]


def test_the_table_decomposes_the_loss_and_keeps_its_kernel_on_cpu():
    assert picofx.kernels.inductor_decompositions()[OP] is linear_cross_entropy_decomposition
    assert traced_entry("cpu").count(KERNEL) == 1  # measured faster there (CUSTOM_OP_DEVICES)
    on_meta = traced_entry("meta")  # any other device: ATen ops only
    assert KERNEL not in on_meta and OP not in on_meta and sum(t in MATMULS for t in on_meta) == 12
