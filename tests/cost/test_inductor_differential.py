"""The Inductor memory model against Inductor itself: one small graph per rule the model mirrors,
compiled by Inductor (CPU) and run; the predicted peak is within 2% of the measured one. Each
graph is one where the rule matters (the graph-order count misses by more than 10%) unless its
test says otherwise. The last tests change one of Inductor's switches and see the prediction
follow Inductor, and stand in for another torch release."""
import warnings

import pytest
import torch
from torch._inductor import config
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from picofx.cost.inductor.measured import measured_peak
from picofx.cost.inductor.model import GraphOrderMemoryModel, InductorMemoryModel
from picofx.cost.inductor.workspace import workspace_bytes
from picofx.cost.inductor.kernel_order import inductor_fusion
from picofx.cost.inductor.switches import InductorSwitches
from picofx.cost.liveness import schedule_of, storage_key, timeline

pytestmark = pytest.mark.slow

N = 256  # (N, N) fp32 values: 256 KiB each
attend = torch.nn.functional.scaled_dot_product_attention


def peaks(f, *shapes) -> tuple[int, int, int]:
    """(predicted by the Inductor model, counted in graph order, measured under Inductor), bytes
    above the graph's inputs, under Inductor's config as it is now."""
    gm = make_fx(f, decomposition_table=select_decomp_table(), tracing_mode="fake")(*map(torch.randn, shapes))
    s = schedule_of(gm)
    resident = {storage_key(n.meta["val"]) for n in s.inputs}
    return (InductorMemoryModel().timeline(s, resident, workspace=workspace_bytes).peak,
            GraphOrderMemoryModel().timeline(s, resident, workspace=workspace_bytes).peak, measured_peak(s, resident))


def check(f, *shapes, exercised: bool = True) -> None:
    predicted, graph_order, measured = peaks(f, *shapes)
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)
    if exercised:
        assert abs(graph_order - measured) > 0.1 * measured, "the graph does not exercise the rule"


def chain(x, w):
    h = x @ w
    y = ((h * 2).sin() + 1).relu() * h  # one kernel: the intermediates stay in registers
    return (y @ w,)


def test_a_pointwise_chain_is_one_kernel():
    check(chain, (N, N), (N, N))


def test_a_reduction_fuses_with_the_loops_that_read_its_result():
    def f(x, w):
        h = x @ w
        centred = h - h.mean(1, keepdim=True)  # recomputed in each reader, the means never leave theirs
        scaled = centred * torch.rsqrt((centred * centred).mean(1, keepdim=True) + 1e-5)
        return (scaled @ w[:, :1],)

    check(f, (N, N), (N, N))


def test_extern_kernels_allocate_their_outputs_and_attention_its_scratch():
    def f(x, w):
        q = (x @ w).view(1, 4, N, N // 4)
        mask = torch.where(x[:, :1] > x[:1, :], 0.0, float("-inf"))  # computed just before attention reads it
        out = attend(q, q * 2, q, attn_mask=mask)  # q * 2 copied into a buffer of attention's own
        return ((out.view(N, N) @ w).exp(),)

    check(f, (N, N), (N, N), exercised=False)  # graph order counts these as Inductor does


def freed_then_taken(x, w):
    big = torch.cat([x, x, x]) @ w  # the peak comes before h exists
    total = big.sum()
    h = x @ w  # dies at its sum, then waits on the free list for z
    c = h.sum()
    small = x[:1] @ w
    z = x @ w
    return (total + c + small.sum() + (z @ w).sum(),)


def test_a_freed_buffer_is_kept_for_the_next_allocation_of_its_size():
    # Inductor keeps a buffer only where its own estimate of the peak allows, so the free list
    # seldom moves the peak: here it does not, and the prediction must still hold
    check(freed_then_taken, (N, N), (N, N), exercised=False)


def dies_into(x, w):
    kept = x @ w
    h = x @ w
    a = h.sin()  # written into h's buffer: h dies here
    return (a @ kept[:, :1],)


def test_a_kernel_writes_into_a_dying_input():
    check(dies_into, (N, N), (N, N))


def apart(kernels: int):
    def f(x, w, v):
        h = x @ w
        a = h * 2  # fuses with b below (both read h alike) unless they are too far apart
        z = a[: N // 4, : N // 4]
        for _ in range(kernels):  # matmul kernels in between, after a
            z = z @ v
        t = (x * z.sum()) @ w  # buffers the size of h, after the matmuls
        b = h * 3  # fused with a, it is computed where a is and held past t
        return ((b @ w[:, :1]).sum() + t.sum() + h[0, 0],)  # h lives to the end
    return f


def test_kernels_too_far_apart_do_not_fuse():
    f, shapes = apart(70), [(N, N), (N, N), (N // 4, N // 4)]
    predicted, _, measured = peaks(f, *shapes)
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)
    gm = make_fx(f, decomposition_table=select_decomp_table(), tracing_mode="fake")(*map(torch.randn, shapes))
    s = schedule_of(gm)
    ordered, fusion = inductor_fusion(s, InductorSwitches(long_distance=10**6))  # as if distance did not matter
    resident = {storage_key(n.meta["val"]) for n in s.inputs}
    assert timeline(ordered, resident, fusion=fusion).peak > 1.1 * measured


def fused_early(x, w):
    h = x @ w
    a = h * 2
    small = a @ w[:, :1]  # in graph order a dies here, before b exists
    b = h * 3  # fused with a: a, b and h are live together
    return (small.sum() + (b @ w).sum(),)


def read_twice(x, w):
    h, g = x @ w, x @ w.t()
    v = h * g + x  # loads 3 buffers, read by two kernels: computed in each (4 or fewer), or written once
    m = v.sin() @ w
    return ((v.cos() * m) @ w[:, :1],)


@pytest.mark.parametrize("f,switch,value", [
    (fused_early, "max_fusion_size", 1),  # no two kernels fuse
    (dies_into, "inplace_buffers", False),
    (read_twice, "realize_reads_threshold", 2),
], ids=["max_fusion_size", "inplace_buffers", "realize_reads_threshold"])
def test_the_prediction_follows_inductors_config(f, switch, value):
    shapes = [(N, N), (N, N)]
    default_predicted, _, default_measured = peaks(f, *shapes)
    with config.patch({switch: value}):
        predicted, _, measured = peaks(f, *shapes)
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)
    assert default_predicted == pytest.approx(default_measured, rel=0.02)
    assert abs(measured - default_measured) > 0.1 * default_measured  # the switch changes what Inductor does


def test_on_an_unchecked_torch_release_it_warns_once_and_asks_inductor(monkeypatch):
    from picofx.cost.inductor import model, switches

    monkeypatch.setattr(switches, "CHECKED_TORCH", ("1.0",))
    monkeypatch.setattr(model, "_warned", set())
    with pytest.warns(UserWarning, match="checked against torch 1.0"):
        predicted, _, measured = peaks(chain, (N, N), (N, N))
    assert predicted == measured
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peaks(chain, (N, N), (N, N))
