"""Float8 under Inductor on the CPU: the compiled float8 linear equals eager's bit for bit; the whole
model equals eager where Inductor keeps eager's bf16 roundings; the amax is computed in the kernel
that produces the float8 linear's input (the norm, the SwiGLU product)."""
import copy
import re
import warnings

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import picofx
from picofx.models import zoo
from picofx.models.llama import LlamaConfig, MLP, RMSNorm
from picofx.passes import Precision
from picofx.passes.precision.float8_linear import float8_linear

pytestmark = pytest.mark.slow  # each test compiles with Inductor


def quiet_optimize(model, inputs, passes, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Precision\(float8=...\) on the CPU")
        return picofx.optimize(model, inputs, passes, **kwargs)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_float8_linear_of_a_fused_bf16_producer_equals_eager_bit_for_bit(recipe):
    """Inductor's C++ code hands a consumer fused with a bf16 producer the producer's unrounded fp32
    value; the float8 amax and cast read the rounded bf16 one, as eager does (before: 1.6% off)."""
    torch.manual_seed(0)
    x, w, grad = torch.randn(64, 32), torch.randn(48, 32), torch.randn(64, 48, dtype=torch.bfloat16)

    def norm_then_float8(x, w):
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        return float8_linear(normed, w.to(torch.bfloat16), recipe)

    results = []
    for fn in (norm_then_float8, torch.compile(norm_then_float8, backend="inductor")):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xx, ww)
        out.backward(grad)
        results.append((out, ww.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_the_model_compiled_on_a_cpu_equals_eager_keeping_eager_s_bf16_roundings():
    """The tiny LLaMA, every linear in float8: Inductor's default fuses bf16 ops without rounding
    between them, which moves a tensorwise amax and so every rounding of that cast (loss ~5e-5,
    gradients ~10% off eager: two draws of float8's noise). With emulate_precision_casts it keeps
    eager's roundings, and compiled float8 equals eager float8 (loss 1e-6, gradients 1e-5)."""
    z = zoo.build("llama-tiny")
    runs = {}
    for backend in ("eager", "inductor"):
        model = copy.deepcopy(z.model)
        opt = quiet_optimize(model, z.example_inputs, [Precision(float8="tensorwise", float8_layers="all")],
                             backend=backend, loss_fn=z.loss_fn)  # on a CPU picofx compiles float8 with it on
        loss = opt(**z.example_inputs)
        loss.backward()
        runs[backend] = loss.item(), model
    (eager_loss, eager), (compiled_loss, compiled) = runs["eager"], runs["inductor"]
    assert abs(compiled_loss - eager_loss) < 1e-6 * eager_loss
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert (p.grad - q.grad).norm() < 1e-5 * p.grad.norm(), name


class NormThenMLP(nn.Module):
    """A decoder layer's feed-forward half: RMSNorm, then SwiGLU's three linear layers."""

    def __init__(self):
        super().__init__()
        config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2)
        self.norm, self.mlp = RMSNorm(32, 1e-6), MLP(config)

    def forward(self, x):
        return self.mlp(self.norm(x)).float().pow(2).mean()


def test_the_amax_is_computed_in_the_kernel_that_produces_the_input():
    """With fuse, the float8 linears read rms_norm's and silu_mul's outputs; on the CPU Inductor puts
    the amax reduction of each in the same C++ kernel as its producer: no separate pass over it."""
    torch.manual_seed(0)
    model, x = NormThenMLP(), torch.randn(4, 16, 32)
    opt, codes = run_and_get_code(lambda: quiet_optimize(
        model, (x,), ["fuse", Precision(float8="tensorwise", float8_layers="all")], backend="inductor"))
    fused = next(r.notes for r in opt.report.records if r.name == "fuse")
    assert fused["rms_norm"] == 1 and fused["swiglu"] == 1
    forward = next(code for code in codes if "_scaled_mm" in code)
    kernels = re.findall(r"(cpp_fused_\w+) = async_compile", forward)
    norm_kernels = [k for k in kernels if "rms_norm" in k]
    swiglu_kernels = [k for k in kernels if "silu_mul" in k]
    assert norm_kernels and all("amax" in k for k in norm_kernels), kernels
    assert swiglu_kernels and all("amax" in k for k in swiglu_kernels), kernels
