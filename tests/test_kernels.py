"""picofx.kernels' pointwise ops against the unfused plain-torch graphs the fuse pass replaces.

Forward outputs and the gradient of every input are compared (fp32: rtol 1e-5, atol 1e-6).
linear_cross_entropy is tested in test_kernels_linear_cross_entropy.py, the Triton kernels in
test_kernels_triton.py.
"""
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import EPS, check_matches_unfused, randn

import picofx.kernels  # noqa: F401  registers torch.ops.picofx
from picofx.kernels import inductor_decompositions

ops = torch.ops.picofx
few_examples = settings(max_examples=15, deadline=None)
leading_dims = st.lists(st.integers(1, 5), min_size=1, max_size=3)


# ---- the unfused graphs ------------------------------------------------------------------

def rms_norm_unfused(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_unfused(x, residual, weight, eps):
    total = x + residual
    return total, rms_norm_unfused(total, weight, eps)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_unfused(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# ---- rms_norm, add_rms_norm --------------------------------------------------------------

@few_examples
@given(leading=leading_dims, hidden=st.integers(1, 70))
def test_rms_norm_matches_unfused(leading, hidden):
    x, weight = randn(*leading, hidden), randn(hidden)
    check_matches_unfused(ops.rms_norm, rms_norm_unfused, x, weight, EPS)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_bf16_input(weight_dtype):
    x, weight = randn(4, 7, 48, dtype=torch.bfloat16), randn(48, dtype=weight_dtype)
    out = ops.rms_norm(x, weight, EPS)
    assert out.dtype == weight_dtype  # fp32 weight * bf16 x is fp32, as in the unfused graph
    check_matches_unfused(ops.rms_norm, rms_norm_unfused, x, weight, EPS, low_precision=True)


def test_norms_with_out_dtype_compute_in_fp32_and_round_once_at_the_end():
    """An fp32 stream and weight with out_dtype=bf16: the fp32 norm, then one cast (the unfused norm
    under autocast, whose next matmul rounds it); bit for bit, forward and every gradient, and the
    backward of the bf16 output reaches the fp32 inputs."""
    def add_rms_norm_then_cast(x, residual, weight, eps):
        total, normed = add_rms_norm_unfused(x, residual, weight, eps)
        return total, normed.to(torch.bfloat16)

    x, residual, weight = randn(3, 5, 48), randn(3, 5, 48), randn(48)
    check_matches_unfused(lambda *a: ops.rms_norm(*a, out_dtype=torch.bfloat16),
                          lambda *a: rms_norm_unfused(*a).to(torch.bfloat16), x, weight, EPS)
    check_matches_unfused(lambda *a: ops.add_rms_norm(*a, out_dtype=torch.bfloat16), add_rms_norm_then_cast,
                          x, residual, weight, EPS)
    total, normed = ops.add_rms_norm(x, residual, weight, EPS, out_dtype=torch.bfloat16)
    assert (total.dtype, normed.dtype) == (torch.float32, torch.bfloat16)
    with torch._subclasses.FakeTensorMode():  # the fake agrees
        fake = ops.rms_norm(torch.empty(2, 48), torch.empty(48), EPS, out_dtype=torch.bfloat16)
    assert fake.dtype == torch.bfloat16


def test_rms_norm_strided_input():
    x = randn(48, 6).T  # (6, 48), column-major
    check_matches_unfused(ops.rms_norm, rms_norm_unfused, x, randn(48), EPS)
    assert ops.rms_norm(x, randn(48), EPS).is_contiguous()


@few_examples
@given(leading=leading_dims, hidden=st.integers(1, 70))
def test_add_rms_norm_matches_unfused(leading, hidden):
    x, residual, weight = randn(*leading, hidden), randn(*leading, hidden), randn(hidden)
    check_matches_unfused(ops.add_rms_norm, add_rms_norm_unfused, x, residual, weight, EPS)


def test_add_rms_norm_bf16_with_fp32_weight():
    x, residual = randn(3, 5, 32, dtype=torch.bfloat16), randn(3, 5, 32, dtype=torch.bfloat16)
    check_matches_unfused(ops.add_rms_norm, add_rms_norm_unfused, x, residual, randn(32), EPS, low_precision=True)


def test_add_rms_norm_gradient_through_sum_only():
    x, residual, weight = randn(4, 16), randn(4, 16), randn(16)
    total, _ = ops.add_rms_norm(x, residual, weight, EPS)
    total.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    torch.testing.assert_close(residual.grad, torch.ones_like(residual))
    torch.testing.assert_close(weight.grad, torch.zeros_like(weight))


# ---- silu_mul -------------------------------------------------------------------------------

@few_examples
@given(leading=leading_dims, width=st.integers(1, 70))
def test_silu_mul_matches_unfused(leading, width):
    a, b = randn(*leading, width), randn(*leading, width)
    check_matches_unfused(ops.silu_mul, lambda a, b: F.silu(a) * b, a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_on_halves_of_merged_gate_up(dtype):
    gate_up = randn(2, 5, 2 * 24, dtype=dtype)

    def fused(gate_up):
        return ops.silu_mul(*gate_up.chunk(2, dim=-1))

    def unfused(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    check_matches_unfused(fused, unfused, gate_up, low_precision=dtype == torch.bfloat16)


# ---- rope -------------------------------------------------------------------------------------

def cos_sin(*shape, dtype=torch.float32, grad=False):
    return randn(*shape, dtype=dtype, grad=grad), randn(*shape, dtype=dtype, grad=grad)


@few_examples
@given(batch=st.integers(1, 3), seq=st.integers(1, 6), kv_heads=st.integers(1, 3),
       group=st.integers(1, 3), half_dim=st.integers(1, 8))
def test_rope_gqa_reference_layout(batch, seq, kv_heads, group, half_dim):
    dim = 2 * half_dim
    q, k = randn(batch, seq, kv_heads * group, dim), randn(batch, seq, kv_heads, dim)  # (B, T, H, D)
    cos, sin = cos_sin(seq, 1, dim)  # (T, 1, D)
    check_matches_unfused(ops.rope, rope_unfused, q, k, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_gqa_hugging_face_layout(dtype):
    batch, seq, heads, kv_heads, dim = 2, 5, 6, 2, 8
    q = randn(batch, seq, heads, dim, dtype=dtype).transpose(1, 2)  # (B, H, T, D), strided
    k = randn(batch, seq, kv_heads, dim, dtype=dtype).transpose(1, 2)
    cos, sin = cos_sin(batch, 1, seq, dim, dtype=dtype)  # (B, 1, T, D)
    check_matches_unfused(ops.rope, rope_unfused, q, k, cos, sin, low_precision=dtype == torch.bfloat16)


def test_rope_keeps_each_input_dimension_order_forward_and_backward():
    q = randn(2, 5, 6, 8).transpose(1, 2)  # (B, H, T, D) views of (B, T, H, D) projections, as HF has them
    k = randn(2, 5, 2, 8).transpose(1, 2)
    cos, sin = cos_sin(2, 1, 5, 8)
    q_out, k_out = ops.rope(q, k, cos, sin)
    with torch._subclasses.FakeTensorMode() as mode:
        faked = ops.rope(*(mode.from_tensor(t) for t in (q, k, cos, sin)))
    for x, out, fake in zip((q, k), (q_out, k_out), faked):
        assert out.stride() == x.stride() == fake.stride()  # the attention output after it reshapes as a view
    grad_q = randn(2, 5, 6, 8).transpose(1, 2)
    grad_k = randn(2, 5, 2, 8).transpose(1, 2)
    for g, grad_in in zip((grad_q, grad_k), ops.rope_backward(grad_q, grad_k, cos, sin)):
        assert grad_in.stride() == g.stride()


def test_rope_bf16_queries_fp32_tables():
    q, k = randn(2, 4, 4, 8, dtype=torch.bfloat16), randn(2, 4, 2, 8, dtype=torch.bfloat16)
    cos, sin = cos_sin(4, 1, 8)
    q_out, _ = ops.rope(q, k, cos, sin)
    assert q_out.dtype == torch.float32  # promotion, as in the unfused graph
    check_matches_unfused(ops.rope, rope_unfused, q, k, cos, sin, low_precision=True)


def test_rope_gradient_for_cos_sin_when_required():
    q, k = randn(2, 3, 4, 8), randn(2, 3, 2, 8)
    cos, sin = cos_sin(3, 1, 8, grad=True)
    check_matches_unfused(ops.rope, rope_unfused, q, k, cos, sin)


def test_rope_no_gradient_for_constant_cos_sin():
    q, k = randn(2, 3, 4, 8), randn(2, 3, 2, 8)
    cos, sin = cos_sin(3, 1, 8)
    q_out, k_out = ops.rope(q, k, cos, sin)
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad is not None and k.grad is not None and cos.grad is None and sin.grad is None


# ---- opcheck: schema, fake implementation, autograd registration, aot dispatch --------------

OPCHECK_CASES = {
    "rms_norm": (ops.rms_norm.default, lambda: (randn(3, 4, 16), randn(16), EPS)),
    "rms_norm_bf16": (ops.rms_norm.default, lambda: (randn(3, 16, dtype=torch.bfloat16), randn(16), EPS)),
    "rms_norm_strided": (ops.rms_norm.default, lambda: (randn(16, 3).T, randn(16), EPS)),
    "add_rms_norm": (ops.add_rms_norm.default, lambda: (randn(3, 16), randn(3, 16), randn(16), EPS)),
    "rms_norm_backward": (ops.rms_norm_backward.default,
                          lambda: (torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), EPS, torch.randn(3, 16))),
    "silu_mul": (ops.silu_mul.default, lambda: randn(3, 2 * 8).chunk(2, -1)),
    "silu_mul_backward": (ops.silu_mul_backward.default,
                          lambda: (torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8))),
    "rope": (ops.rope.default, lambda: (randn(2, 3, 4, 8), randn(2, 3, 2, 8), *cos_sin(3, 1, 8))),
    "rope_strided_cos_grad": (ops.rope.default,
                              lambda: (randn(2, 3, 4, 8).transpose(1, 2), randn(2, 3, 2, 8).transpose(1, 2),
                                       *cos_sin(2, 1, 3, 8, grad=True))),
    "rope_backward": (ops.rope_backward.default,
                      lambda: (torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8), *cos_sin(3, 1, 8))),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    op, make_args = OPCHECK_CASES[case]
    torch.library.opcheck(op, make_args())


# ---- decompositions for Inductor on CPU -----------------------------------------------------

def pointwise_block(x, residual, weight, gate_up, q, k, cos, sin):
    total, normed = ops.add_rms_norm(x, residual, weight, EPS)
    hidden = ops.silu_mul(*gate_up.chunk(2, dim=-1))
    q_out, k_out = ops.rope(q, k, cos, sin)
    return ops.rms_norm(total, weight, EPS).sum() + normed.sum() + hidden.sum() + q_out.sum() + k_out.sum()


def pointwise_block_inputs():
    return [randn(2, 3, 16), randn(2, 3, 16), randn(16), randn(2, 3, 2 * 12),
            randn(2, 3, 4, 8), randn(2, 3, 2, 8), *cos_sin(3, 1, 8)]


def test_inductor_decompositions_cover_the_pointwise_ops():
    decompositions = inductor_decompositions()
    assert set(decompositions) == {ops.rms_norm.default, ops.add_rms_norm.default, ops.rms_norm_backward.default,
                                   ops.silu_mul.default, ops.silu_mul_backward.default,
                                   ops.gelu_mul.default, ops.gelu_mul_backward.default,
                                   ops.rope.default, ops.rope_backward.default, ops.linear_cross_entropy.default}


def picofx_ops_in(graph):
    return {str(node.target) for node in graph.nodes
            if node.op == "call_function" and str(node.target).startswith("picofx.")}


@pytest.mark.parametrize("decompose", [False, True])
def test_decompositions_replace_ops_but_keep_the_custom_backward(decompose):
    from functorch.compile import aot_function, make_boxed_func
    graphs, calls = {}, []

    def counted(name, fn):
        def decomposition(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return decomposition

    decompositions = {op: counted(op.name(), fn) for op, fn in inductor_decompositions().items()}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm.graph
            return make_boxed_func(gm)
        return compiler

    compiled = aot_function(pointwise_block, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                            decompositions=decompositions if decompose else {})
    inputs = pointwise_block_inputs()
    check_matches_unfused(compiled, pointwise_block, *inputs)
    if decompose:
        assert picofx_ops_in(graphs["forward"]) == picofx_ops_in(graphs["backward"]) == set()
        # The backward graph was built from the ops' own autograd formulas:
        assert {"picofx::rms_norm_backward", "picofx::silu_mul_backward", "picofx::rope_backward"} <= set(calls)
    else:
        assert picofx_ops_in(graphs["forward"]) == {"picofx.add_rms_norm.default", "picofx.silu_mul.default",
                                                    "picofx.rope.default", "picofx.rms_norm.default"}
        assert picofx_ops_in(graphs["backward"]) == {"picofx.rms_norm_backward.default",
                                                     "picofx.silu_mul_backward.default", "picofx.rope_backward.default"}


@pytest.mark.slow
def test_inductor_generates_code_for_decomposed_ops():
    with warnings.catch_warnings():  # its first import loads torch.utils.mkldnn, which uses torch.jit
        warnings.filterwarnings("ignore", message=r"`torch.jit.script_method` is deprecated",
                                category=DeprecationWarning)
        from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    def block_and_loss(*inputs):
        *block_inputs, head, labels = inputs
        hidden = ops.rms_norm(block_inputs[0], block_inputs[2], EPS)  # (2, 3, 16)
        loss = ops.linear_cross_entropy(hidden, head, None, labels, -100, "mean", True, 4, True)[0]
        return (pointwise_block(*block_inputs) + loss,)

    inputs = [*pointwise_block_inputs(), randn(10, 16), torch.randint(0, 10, (2, 3))]
    aten_graph = make_fx(block_and_loss)(*inputs)
    assert len(picofx_ops_in(aten_graph.graph)) == 5

    def compile_and_train_step():
        compiled = compile_fx(aten_graph, inputs, decompositions={**select_decomp_table(), **inductor_decompositions()})
        return check_matches_unfused(lambda *args: compiled(*args)[0], lambda *args: block_and_loss(*args)[0], *inputs)

    _, (forward_code, backward_code) = run_and_get_code(compile_and_train_step)
    # Only linear_cross_entropy's kernel stays an opaque call (on CPU, where it is faster than its
    # decomposition); the rest became Inductor's own C++ loops (comments still name the ops).
    assert set(re.findall(r"torch\.ops\.picofx\.(\w+)", forward_code)) == {"linear_cross_entropy_kernel"}
    assert set(re.findall(r"torch\.ops\.picofx\.(\w+)", backward_code)) == set()
    assert "cpp_fused" in forward_code and "cpp_fused" in backward_code
