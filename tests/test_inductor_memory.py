"""The cost model's account of how Inductor runs a graph: fused kernels, their order, buffer reuse."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from picofx.fused_buffers import unmaterialized
from picofx.kernel_order import fused_kernels, inductor_fusion, kernel_order
from picofx.liveness import Fusion, schedule_of, storage_key, timeline

N = 64  # (N, N) fp32 values: 16 KiB each
KiB16 = N * N * 4


def _graph(f, count: int):
    gm = make_fx(f, tracing_mode="fake")(*[torch.randn(N, N) for _ in range(count)])
    nodes = {n.name: n for n in gm.graph.nodes}
    return gm, schedule_of(gm), nodes


def _resident(s):
    return {storage_key(n.meta["val"]) for n in s.inputs}


def test_loops_that_read_one_buffer_fuse_unless_a_kernel_sits_between_them():
    def f(x, w):
        h = x @ w
        a = h * 2  # a and b read h and feed matmuls: two loops over h, one kernel
        b = h * 3
        c = h + 1  # c feeds a matmul whose result e reads: fusing c and e would make a cycle
        d = c @ w
        e = d * h
        return (a @ w + b @ w + e,)

    gm, s, nodes = _graph(f, 2)
    groups = [{n.name for n in g} for g in fused_kernels(s, unmaterialized(s))]
    together = next(g for g in groups if "mul" in g)
    assert {"mul", "mul_1"} <= together
    assert not any({"add", "mul_2"} <= g for g in groups)


def test_a_fused_kernel_runs_where_its_first_member_stood_after_what_it_needs():
    def f(x, w, v):
        h = x @ w
        a = h * 2  # first member
        g = a @ w  # reads a: runs after the whole kernel
        k = h @ v  # the second member needs k: k moves before the kernel
        b = h * k
        return (g @ w + b @ v,)

    gm, s, nodes = _graph(f, 3)
    ordered, kernel_end = kernel_order(s, unmaterialized(s))
    position = {n.name: i for i, n in enumerate(ordered.steps)}
    assert position["mm_2"] < position["mul"] < position["mul_1"] < position["mm_1"]
    assert kernel_end[nodes["mul"]] is kernel_end[nodes["mul_1"]] is nodes["mul_1"]


def test_a_fused_kernel_holds_all_its_outputs_and_inputs_at_once():
    def f(x, w):
        h = x @ w
        a = h * 2
        small = a @ w[:, :1]  # in graph order a dies here, before b exists
        b = h * 3  # fused with a: a, b and h are live together
        return (small.sum() + (b @ w).sum(),)

    gm, s, nodes = _graph(f, 2)
    ordered, fusion = inductor_fusion(s)
    fused = timeline(ordered, _resident(s), fusion=fusion)
    assert dict(zip((n.name for n in fused.nodes), fused.live))["mul_1"] == 3 * KiB16
    assert timeline(s, _resident(s)).peak < 3 * KiB16


def test_a_freed_buffer_is_held_until_an_allocation_of_its_size_takes_it():
    def f(x, w):
        h = x @ w  # 16 KiB, last read by the sum
        c = h.sum()
        big = torch.cat([x, x]) @ w  # 32 KiB: another size, so h waits on the free list
        z = x @ w  # 16 KiB: takes h's buffer
        return (big.sum() + c + z.sum(),)

    gm, s, nodes = _graph(f, 2)
    ordered, fusion = inductor_fusion(s)
    freed = timeline(ordered, _resident(s), fusion=Fusion(fusion.in_registers, fusion.in_place, fusion.kernel_end))
    held = timeline(ordered, _resident(s), fusion=fusion)
    freed_at = dict(zip((n.name for n in freed.nodes), freed.live))
    held_at = dict(zip((n.name for n in held.nodes), held.live))
    assert held_at["mm_1"] == freed_at["mm_1"] + KiB16
    assert held_at["mm_2"] == freed_at["mm_2"]  # z lives in h's buffer: nothing new
