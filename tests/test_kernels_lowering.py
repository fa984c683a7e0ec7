"""How Inductor lowers picofx's fused ops: decomposed on every device, or on CUDA as picofx's Triton
kernels launched through wrap_triton (picofx.kernels.lowering). No fused op stays an opaque call.

Without a GPU the Triton lowering is traced on CPU tensors (fake values: no kernel runs) with a
stand-in CUDA target, so that Inductor's analysis of what each kernel writes runs as on a GPU.
"""
import importlib

import pytest
import torch
from functorch.compile import aot_function, make_boxed_func

import picofx.kernels  # noqa: F401  registers torch.ops.picofx
from picofx.kernels import inductor_decompositions
from picofx.kernels.lowering import TRITON_KERNELS, triton_lowering, with_backward_ops
from picofx.runtime.compile import inductor_decompositions as compile_table, triton_lowered_ops

FUSED = ["rms_norm", "add_rms_norm", "rms_norm_backward", "silu_mul", "silu_mul_backward",
         "gelu_mul", "gelu_mul_backward", "rope", "rope_backward"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_compile_table_decomposes_every_fused_op_on_every_device(device):
    table = {op.name() for op in compile_table(torch.device(device))}
    assert {f"picofx::{name}" for name in FUSED} <= table


def test_backward_ops_follow_their_forward_ops():
    pytest.importorskip("triton")
    assert with_backward_ops(["picofx::add_rms_norm"]) == {"picofx::add_rms_norm", "picofx::rms_norm_backward"}
    assert with_backward_ops(["picofx::rope"]) == {"picofx::rope", "picofx::rope_backward"}
    with pytest.raises(KeyError, match="gelu_mul"):
        with triton_lowering(["picofx::gelu_mul"]):  # it has no Triton kernel
            pass


def test_triton_lowered_ops_come_from_the_graph_and_fuse_choice():
    pytest.importorskip("triton")

    def f(x, w, a, b):
        return torch.ops.picofx.rms_norm.default(x, w, 1e-5), torch.ops.picofx.silu_mul.default(a, b)

    gm = torch.fx.symbolic_trace(f)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_lowered_ops(gm, cuda) == {"picofx::rms_norm", "picofx::silu_mul"}
    assert triton_lowered_ops(gm, cpu) == set()  # on CPU the decompositions always
    next(n for n in gm.graph.nodes if "silu_mul" in str(n.target)).meta["lowering"] = "decomposed"
    assert triton_lowered_ops(gm, cuda) == {"picofx::rms_norm"}


@pytest.fixture
def stand_in_cuda_target(monkeypatch):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    driver = importlib.import_module("triton.runtime.driver").driver

    class Target:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(driver, "_active", Target())
    return triton


def traced_graphs(fn, inputs, lowered):
    """The forward and backward graphs AOT traces for `fn`; each runs as zeros of its outputs' shapes
    (launching a kernel needs a GPU)."""
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            return make_boxed_func(lambda *args: [None if o is None else torch.zeros_like(o.meta["val"]) for o in outputs])
        return compiler

    with triton_lowering(lowered):
        compiled = aot_function(fn, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                decompositions=inductor_decompositions())
        compiled(*inputs).backward()
    return graphs


def block(x, residual, w, gate, up, q, k, cos, sin):
    total, normed = torch.ops.picofx.add_rms_norm(x, residual, w, 1e-5)
    q, k = torch.ops.picofx.rope(q, k, cos, sin)
    return (torch.ops.picofx.rms_norm(normed, w, 1e-5).sum() + torch.ops.picofx.silu_mul(gate, up).sum()
            + total.sum() + q.sum() + k.sum())


def block_inputs():
    rows = [torch.randn(2, 3, 8, requires_grad=True) for _ in range(2)]
    heads = [torch.randn(1, 2, 3, 8, requires_grad=True) for _ in range(2)]
    cos, sin = torch.randn(3, 8), torch.randn(3, 8)
    return [*rows, torch.randn(8, requires_grad=True), *[torch.randn(2, 3, 16, requires_grad=True) for _ in range(2)],
            *heads, cos, sin]


def test_lowered_ops_become_triton_kernels_inductor_sees(stand_in_cuda_target):
    graphs = traced_graphs(block, block_inputs(), sorted(TRITON_KERNELS))
    assert set(graphs) == {"forward", "backward"}
    for role, gm in graphs.items():
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        assert not [t for t in targets if t.startswith("picofx.")], (role, targets)
        kernels = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
        assert kernels, role
        for node in kernels:  # each kernel writes only the buffers it allocated: no input is copied for it
            written = {node.kwargs["kwargs"][name] for name in node.kwargs["tensors_to_clone"]}
            fresh = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_permuted.default)  # rope: its input's order
            assert all(w.target in fresh for w in written), (role, node)


def test_ops_not_lowered_are_decomposed(stand_in_cuda_target):
    graphs = traced_graphs(block, block_inputs(), ["picofx::silu_mul"])
    forward = graphs["forward"]
    assert not [n for n in forward.graph.nodes if str(n.target).startswith("picofx.")]
    kernels = [n for n in forward.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    assert len(kernels) == 1  # silu_mul's; the norms and RoPE are plain ATen ops Inductor fuses
