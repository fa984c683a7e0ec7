"""tensor_parallel's float8 collectives scheduled as its others (picofx.parallel.maxima, lower.py):
one process in a fake two-rank group (no data moves) builds the tiny LLaMA's graphs under
TensorParallel and Precision(float8="tensorwise") on the attention's projections, and the test reads
the order of the graphs that run. Numerics: tests/passes/test_tensor_parallel_float8.py."""
from __future__ import annotations

import warnings

import pytest
import torch

import picofx
from picofx.capture.vocabulary import VIEW_OPS
from picofx.models import zoo
from picofx.passes import TensorParallel

import tensor_parallel_float8_ranks as ranks
from spawn_ranks import fake_ranks

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
LAYOUT_OPS = VIEW_OPS | {aten.clone.default, aten.view.dtype, aten.detach.default}
WEIGHTS = 2 * 4  # q, k, v, out of both layers


@pytest.fixture(scope="module")
def graphs():
    """{"tp" | "sp": {"forward" | "backward": graph}}."""
    with fake_ranks(2):
        built = {}
        for case, options in {"tp": {}, "sp": {"sequence_parallel": True, "async_overlap": False}}.items():
            z = zoo.build("llama-tiny")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"Precision\(float8=...\) on the CPU")
                opt = picofx.optimize(z.model, z.example_inputs, [TensorParallel(**options),
                                                                  ranks.fp32_elsewhere("tensorwise")],
                                      backend="eager", loss_fn=z.loss_fn)
            opt.forward_backward(**z.example_inputs)
            built[case] = {role: opt.graphs[role].graph for role in ("forward", "backward")}
        yield built


def issued(graph, target, *args) -> list[tuple]:
    """(issue, its wait, the nodes between them) of each collective `target` with args[1:] == args."""
    nodes = list(graph.nodes)
    found = []
    for i, node in enumerate(nodes):
        if node.target is target and tuple(node.args[1:1 + len(args)]) == args:
            wait = next(u for u in node.users if u.target is c10d.wait_tensor.default)
            found.append((node, wait, nodes[i + 1:nodes.index(wait)]))
    return found


def is_float8_cast(node) -> bool:
    return node.target is aten._to_copy.default and node.kwargs.get("dtype") == torch.float8_e4m3fn


def float8_scale_reductions(graph) -> list:
    """The max all-reduces of float8 amaxes (all but the loss's softmax maximum, a row's)."""
    return [(issue, wait, between) for issue, wait, between in issued(graph, c10d.all_reduce.default, "max")
            if not (issue.args[0].target is aten.amax.default and list(issue.args[0].args[1:2]) == [[-1]])]


@pytest.mark.parametrize("case", ["tp", "sp"])
def test_weight_amaxes_are_one_all_reduce_issued_before_the_first_matmul(graphs, case):
    for role in ("forward", "backward"):
        graph = graphs[case][role]
        stacked = [(issue, wait, between) for issue, wait, between in float8_scale_reductions(graph)
                   if issue.args[0].target is aten.cat.default]
        assert len(stacked) == 1, role  # one collective for the scales of every weight
        issue, wait, between = stacked[0]
        assert len(issue.args[0].args[0]) >= WEIGHTS, role  # the backward's also has saved activations'
        nodes = list(graph.nodes)
        first_matmul = next(n for n in nodes if n.target in (aten._scaled_mm.default, aten.mm.default))
        assert nodes.index(issue) < nodes.index(first_matmul), role
        assert any(n.target not in LAYOUT_OPS for n in between), role


@pytest.mark.parametrize("case", ["tp", "sp"])
def test_every_amax_all_reduce_has_compute_between_its_issue_and_its_wait_at_the_cast(graphs, case):
    """Each wait sits just before the cast that reads its scale, after other work (casts, other issues)."""
    for role in ("forward", "backward"):
        reductions = float8_scale_reductions(graphs[case][role])
        assert reductions, role
        for issue, wait, between in reductions:
            assert len([n for n in between if n.target not in LAYOUT_OPS]) >= 3, (role, issue.name)
            derived, reader = {wait}, wait.next
            while all(a in derived for a in reader.all_input_nodes):  # the scale, from the maximum alone
                derived.add(reader)
                reader = reader.next
            assert wait in reader.all_input_nodes or derived & set(reader.all_input_nodes), (role, issue.name)


def test_sequence_parallel_float8_gather_waits_just_before_its_matmuls(graphs):
    """The weights' casts run while the e4m3 rows travel; the wait, then their layout, then the matmul."""
    gathers = [(issue, wait, between) for issue, wait, between in
               issued(graphs["sp"]["forward"], c10d.all_gather_into_tensor.default)
               if issue.args[0].meta["val"].dtype == torch.uint8]
    assert len(gathers) == 2
    for issue, wait, between in gathers:
        assert sum(map(is_float8_cast, between)) == 2  # k and v weights (q: behind the amax)
        node = wait.next
        while node.target in LAYOUT_OPS:
            node = node.next
        assert node.target is aten._scaled_mm.default


@pytest.mark.parametrize("case, target", [("tp", c10d.all_reduce.default),
                                          ("sp", c10d.reduce_scatter_tensor.default)])
def test_float8_weight_gradients_run_while_the_input_gradient_travels(graphs, case, target):
    """q, k, v's input gradient (summed over tp) is issued before their float8 weight-gradient matmuls."""
    behind = [n for _, _, between in issued(graphs[case]["backward"], target, *(("sum",) if case == "tp" else ()))
              for n in between if n.target is aten._scaled_mm.default]
    assert len(behind) == 2 * 3
