"""Pass `precision` at the edges of its policy: what the model computes in fp32 on purpose stays
fp32 (complex RoPE, an explicit upcast), ops from outside ATen and picofx get their traced input
dtypes back at their boundary, and an op that rejects its new dtypes fails when optimize runs."""
import pytest
import torch
import torch.nn.functional as F
from precision_models import BF16, FP32, dtype, float_inputs
from torch import nn

import picofx
from picofx import PassError
from picofx.models import real_models
from picofx.passes import Precision
from picofx.passes.precision.rules import op_name
from picofx.testing import captured, run_pass


def nodes_of(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target) == name]


def test_complex_rope_computes_in_fp32():
    gm, ctx = captured(real_models.build("meta-llama"))
    record = run_pass(Precision(), gm, ctx, verify="invariants")
    complex_views = nodes_of(gm, "aten.view_as_complex")
    assert len(complex_views) == 4 and record.notes["rules"]["complex"] == 4  # q and k, 2 layers
    assert all({dtype(a) for a in float_inputs(n)} == {FP32} for n in complex_views)
    assert all(dtype(n) == BF16 for n in nodes_of(gm, "aten.linear"))


class ExplicitUpcast(nn.Module):
    """A bf16 model whose head the model computes in fp32 on purpose."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16, dtype=BF16)
        self.head = nn.Linear(16, 8, dtype=BF16)

    def forward(self, x):
        h = self.body(x)
        return F.linear(h.float(), self.head.weight.float()).logsumexp(-1).sum()


def test_an_op_the_model_upcast_itself_is_not_lowered():
    model = ExplicitUpcast()
    opt = picofx.optimize(model, (torch.randn(4, 16, dtype=BF16),), [Precision()], backend="eager")
    head, body = sorted(nodes_of(opt.graph_module, "aten.linear"), key=lambda n: n.meta["val"].shape[-1])
    assert {dtype(a) for a in float_inputs(head)} == {FP32} and dtype(body) == BF16
    assert opt.report.records[0].notes["rules"]["explicit_fp32"] == 1


@torch.library.custom_op("picofx_tests::plain_mm", mutates_args=())
def plain_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b  # needs one dtype


@plain_mm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])  # checks no dtype, as many libraries' fakes


plain_mm.register_autograd(lambda ctx, g: (g @ ctx.b.T, ctx.a.T @ g),
                           setup_context=lambda ctx, inputs, output: setattr(ctx, "a", inputs[0])
                           or setattr(ctx, "b", inputs[1]))


class CustomOpModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.experts = nn.Parameter(torch.randn(16, 8) / 4)

    def forward(self, x):
        return torch.ops.picofx_tests.plain_mm(self.proj(x), self.experts).square().mean()


def test_a_custom_op_gets_its_traced_input_dtypes_back():
    model, x = CustomOpModel(), torch.randn(4, 16)
    opt = picofx.optimize(model, (x,), [Precision()], backend="eager")
    (op,) = nodes_of(opt.graph_module, "picofx_tests.plain_mm")
    assert {dtype(a) for a in float_inputs(op)} == {FP32}
    assert dtype(next(iter(nodes_of(opt.graph_module, "aten.linear")))) == BF16
    torch.testing.assert_close(opt(x), model(x), rtol=2e-2, atol=1e-3)


class Warp(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.grid = nn.Parameter(torch.rand(2, 4, 4, 2) * 2 - 1)

    def forward(self, x):
        return F.grid_sample(self.proj(x).view(2, 1, 4, 4), self.grid, align_corners=False).sum()


def test_an_op_that_rejects_its_new_dtypes_fails_at_optimize_naming_it():
    with pytest.raises(PassError, match=r"node grid_sampler_2d .* does not accept its inputs' new dtypes "
                                        r"\(view: bf16, p_grid: fp32\).*fp32_ops=\('aten.grid_sampler_2d',\)"):
        picofx.optimize(Warp(), (torch.randn(2, 16),), [Precision()], backend="eager")
    kept = picofx.optimize(Warp(), (torch.randn(2, 16),), [Precision(fp32_ops=("aten.grid_sampler_2d",))],
                           backend="eager")
    assert torch.isfinite(kept(torch.randn(2, 16)))
