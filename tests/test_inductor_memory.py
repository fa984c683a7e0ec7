"""The cost model's account of how Inductor runs a graph: fused kernels, their order, buffer reuse."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from picofx.cost.inductor.fused_buffers import VIEWS, is_fallback, unmaterialized
from picofx.cost.inductor.kernel_order import _inlined, _scheduler_ranks, fused_kernels, inductor_fusion, kernel_order
from picofx.cost.liveness import Fusion, schedule_of, storage_key, timeline

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
    ordered, kernel_end, _ = kernel_order(s, unmaterialized(s))
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


def _with_and_without_reuse(f):
    gm, s, nodes = _graph(f, 2)
    ordered, fusion = inductor_fusion(s)
    no_reuse = Fusion(fusion.in_registers, fusion.in_place, fusion.kernel_end, kernel_index=fusion.kernel_index)
    freed = timeline(ordered, _resident(s), fusion=no_reuse)
    held = timeline(ordered, _resident(s), fusion=fusion)
    return dict(zip((n.name for n in freed.nodes), freed.live)), dict(zip((n.name for n in held.nodes), held.live))


def test_a_freed_buffer_is_held_until_an_allocation_of_its_size_takes_it():
    def f(x, w):
        big = torch.cat([x, x, x]) @ w  # 48 KiB: the peak, before h exists
        s = big.sum()
        h = x @ w  # 16 KiB, last read by the sum
        c = h.sum()
        small = x[:1] @ w  # another size: h waits on the free list, below the peak
        z = x @ w  # takes h's buffer
        return (s + c + small.sum() + z.sum(),)

    freed_at, held_at = _with_and_without_reuse(f)
    assert held_at["mm_2"] == freed_at["mm_2"] + KiB16
    assert held_at["mm_3"] == freed_at["mm_3"]  # z lives in h's buffer: nothing new


def test_a_freed_buffer_is_not_held_where_holding_it_would_raise_inductors_peak_estimate():
    def f(x, w):
        h = x @ w  # 16 KiB, last read by the sum
        c = h.sum()
        big = (torch.cat([x, x]) * c) @ w  # 32 KiB twice, after h died: the peak
        z = x @ w  # Inductor's code allocates a fresh buffer here
        return (big.sum() + z.sum(),)

    freed_at, held_at = _with_and_without_reuse(f)
    assert max(held_at.values()) == max(freed_at.values()) < 5 * KiB16


def test_a_costly_value_with_several_readers_gets_a_buffer_that_its_kernel_may_drop():
    def f(x, w):
        h = x @ w
        s = torch.sigmoid(h)  # sigmoid, two readers: Inductor writes s rather than recompute it twice
        t = h * 2  # cheap, two readers: computed inside each
        a = s * t  # a and b fuse with s: s's buffer is dropped
        b = s + t
        g = torch.sigmoid(h + 1)  # g is also read after a matmul that needs its first reader
        m = (g * 3) @ w
        return (a @ w + b @ w + m * g,)

    gm, s, nodes = _graph(f, 2)
    ordered, fusion = inductor_fusion(s)
    assert nodes["mul"] in fusion.in_registers
    assert nodes["sigmoid"] not in fusion.in_registers and nodes["sigmoid"] in fusion.kernel_local
    assert nodes["sigmoid_1"] not in fusion.in_registers and nodes["sigmoid_1"] not in fusion.kernel_local
    line = timeline(ordered, _resident(s), fusion=fusion)
    assert line.allocated_by["sigmoid"] == 0 and line.allocated_by["sigmoid_1"] == KiB16


def test_a_value_only_an_extern_kernel_reads_is_computed_just_before_it():
    def f(x, w):
        mask = torch.where(x > 0, 0.0, float("-inf"))  # read by attention alone: Inductor computes it there
        q = (x @ w).view(1, 1, N, N)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask.view(1, 1, N, N))
        return (out.sum(),)

    gm, s, nodes = _graph(f, 2)
    ordered, fusion = inductor_fusion(s)
    steps = [n for n in ordered.steps if n not in fusion.in_registers and n.target not in VIEWS]
    attention = next(i for i, n in enumerate(steps) if is_fallback(n))
    assert steps[attention - 1] is nodes["where"]
    assert [n.name for n in s.steps].index("where") < [n.name for n in s.steps].index("mm")


def test_a_reduction_fuses_with_a_loop_over_its_result_unless_they_share_a_few_bytes():
    def f(x, w):
        h = x @ w
        rows = h.sum(1)  # N floats, read by a loop over N: one kernel, and `rows` never leaves it
        scaled = rows * 2
        total = h.sum()  # one float: Inductor does not fuse for 4 bytes
        return ((scaled @ w) * total,)

    gm, s, nodes = _graph(f, 2)
    ordered, fusion = inductor_fusion(s)
    assert fusion.kernel_index[nodes["sum_1"]] == fusion.kernel_index[nodes["mul"]]
    assert nodes["sum_1"] in fusion.kernel_local
    groups = [{n.name for n in g} for g in fused_kernels(s, unmaterialized(s))]
    assert not any({"sum_2", "mul_1"} <= g for g in groups)


def test_loops_share_a_broadcast_input_only_when_they_load_it_alike():
    def f(x, w, v, u, c):
        table = c.view(1, 2, 1, N // 2)  # c (N floats) broadcast over dims 0 and 2, as RoPE's tables
        a = (x @ w).view(N // 2, 2, 2, N // 2) * table
        a_too = (x @ v).view(N // 2, 2, 2, N // 2) * table  # the same load of c: fuses with a
        b = (x @ u).view(N, 2, N // 2) * c.view(2, N // 2)  # as many elements, c loaded another way
        return ((a.view(N, N) @ w) + (a_too.view(N, N) @ w) + (b.view(N, N) @ w),)

    gm = make_fx(f, tracing_mode="fake")(*[torch.randn(N, N) for _ in range(4)], torch.randn(N))
    s = schedule_of(gm)
    groups = [{n.name for n in g} for g in fused_kernels(s, unmaterialized(s))]
    assert any({"mul", "mul_1"} <= g for g in groups)  # as Inductor's code for f: two kernels
    assert not any("mul_2" in g for g in groups)


def test_a_split_is_no_kernel_and_a_cat_copies_each_input_not_computed_into_it():
    def f(x, w):
        first, second = (x @ w).split(N // 2, dim=1)  # views of the matmul's buffer
        rotated = torch.cat([-second, first], dim=1)  # -second is written into the cat; first is copied
        return (rotated @ w,)

    gm, s, nodes = _graph(f, 2)
    in_registers = unmaterialized(s)
    ranks = _scheduler_ranks(s.steps, _inlined(s.steps, in_registers), in_registers)
    assert "split" not in {n.name for n in ranks}
    assert [ranks[nodes[name]] for name in ("mm", "neg", "cat", "mm_1")] == [0, 1, 3, 4]


def test_a_value_two_attentions_read_is_copied_for_each_unless_its_code_loads_several_buffers():
    def attend_twice(value_of):
        def f(x, w):
            h = x @ w
            q, value = h.view(1, 1, N, N), value_of(h, x).view(1, 1, N, N)
            attend = torch.nn.functional.scaled_dot_product_attention
            return (attend(q, q, value).sum() + attend(q, value, q).sum(),)
        gm, s, nodes = _graph(f, 2)
        ordered, fusion = inductor_fusion(s)
        attentions = [n for n in ordered.steps if is_fallback(n)]
        live = timeline(ordered, _resident(s), fusion=fusion)
        return fusion.copies, nodes["mul"], attentions, live.live[ordered.steps.index(attentions[0])]

    # as Inductor's code for both: h * 2 is written twice by one kernel, h * x once
    copies, one_load, attentions, live_copied = attend_twice(lambda h, x: h * 2)
    assert copies == {one_load: (attentions[0],)}
    copies, two_loads, _, live_shared = attend_twice(lambda h, x: h * x)
    assert copies == {}
    assert live_copied == live_shared + KiB16


def test_an_input_counts_in_inductors_estimate_as_far_as_its_last_readers_index_reaches():
    def f(q, k, x, table):
        repeated = k[:, :, None].expand(1, 2, 2, N, 16).reshape(1, 4, N, 16)  # copied for attention alone
        out = torch.nn.functional.scaled_dot_product_attention(q, repeated, repeated)
        return (out.sum() + (x * table).sum(),)  # table broadcast over x's rows, in the sum's kernel

    gm = make_fx(f, tracing_mode="fake")(torch.randn(1, 4, N, 16), torch.randn(1, 2, N, 16),
                                         torch.randn(N, N), torch.randn(N))
    s = schedule_of(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    ordered, fusion = inductor_fusion(s)
    # the copy loops over the 4 heads attention takes, indexing k by head // 2: all 4 count
    # (Inductor's estimate sized the bench model's saved k and v so, at twice their bytes)
    assert fusion.read_elements[(nodes["clone"], nodes["k_1"])] == 4 * N * 16
    assert fusion.read_elements[(nodes["sum_2"], nodes["table_1"])] == N  # a broadcast's dims do not count


def test_the_model_reads_inductors_thresholds_when_asked():
    from torch._inductor import config

    from picofx.cost.inductor.switches import unvouched

    def f(x, w):
        h = x @ w
        return ((h * 2) @ w + (h * 3) @ w,)  # two loops over h: one kernel

    gm, s, nodes = _graph(f, 2)
    assert inductor_fusion(s)[1].kernel_end
    with config.patch(max_fusion_size=1):  # a user's config: no two kernels fuse
        assert not inductor_fusion(s)[1].kernel_end
        assert unvouched() is None
    with config.patch(score_fusion_memory_threshold=2 * KiB16):  # h is too small to fuse for
        assert not inductor_fusion(s)[1].kernel_end
    with config.patch(aggressive_fusion=True):  # a switch the model does not mirror
        assert "aggressive_fusion" in unvouched()
