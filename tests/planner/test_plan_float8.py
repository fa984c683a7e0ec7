"""Float8 in the planner: the linears' model against torchao's microbenchmark, float8 plans faster
than bf16 where the device multiplies float8 and refused where it does not, the small linears and the
head kept in bf16, sharded weights gathered in float8 under the tensorwise recipe only, suggestions."""
from __future__ import annotations

import dataclasses
import json

import pytest

from picofx.cost.device import devices
from picofx.cost.gpus import NETWORKS
from picofx.planner.costs import ModelCosts
from picofx.planner.float8 import layer_linears, linear_times, speedup, with_float8
from picofx.planner.layouts import Layout, Run, predict, valid
from picofx.planner.search import enumerate_layouts, plan_layouts
from picofx.planner.models import model_config, parameter_count
from picofx.planner.suggest import Neighbourhood


def llama3_8b(gpu: str = "h100", seq: int = 8192, gpus: int = 8, gpus_per_node: int = 8, batch: int = 16) -> Run:
    """Llama 3.1 8B's costs made from its linears' bf16 time (and as much again for attention and the
    memory-bound kernels), without a capture: what float8 changes is the linears'."""
    config = model_config("llama3-8b")
    device = devices()[gpu]
    linears = [linear_times(devices()["h100"], seq, linear, "tensorwise") for linear in layer_linears(config)]
    forward = 2 * sum(t.bf16_forward for t in linears)
    costs = ModelCosts(config, seq, forward, 2 * forward, 5 * 10**8, 0.2 * forward, 0.4 * forward, 10**9, 10**9,
                       parameter_count(config), 6 * 8e9, layer_matmul_forward_s=forward / 2)
    return Run(costs, device, gpus, gpus_per_node, batch)


def fsdp(gpus: int = 8, precision: str = "bf16") -> Layout:
    return Layout(gpus, 1, 1, shard=True, checkpoint="selective", precision=precision)


def test_the_linear_model_gives_torchaos_microbenchmark_speedups():
    """torchao/float8/README.md on an H100: 0.80x at M, K, N = 1024, 2048, 1024 and 1.39x at 4096, 8192,
    16384; the float8 GEMM share was chosen on the large one only."""
    h100 = devices()["h100"]
    assert speedup(h100, 4096, 8192, 16384) == pytest.approx(1.39, abs=0.02)
    small = speedup(h100, 1024, 2048, 1024)
    assert small < 1 and small == pytest.approx(0.80, abs=0.05)
    assert speedup(h100, 4096, 8192, 16384, "rowwise") < speedup(h100, 4096, 8192, 16384)


def test_float8_is_faster_than_bf16_for_llama3_8b_on_h100():
    run = llama3_8b()
    bf16, tensorwise, rowwise = (predict(run, fsdp(precision=p)) for p in ("bf16", "float8", "float8_rowwise"))
    assert tensorwise.tokens_per_s > 1.15 * bf16.tokens_per_s
    assert bf16.tokens_per_s < rowwise.tokens_per_s < tensorwise.tokens_per_s
    assert tensorwise.matmuls["gate"].startswith("float8") and tensorwise.matmuls["head"].startswith("bf16")
    assert bf16.matmuls == {} and tensorwise.as_json()["precision"] == "float8"
    # split over tp ranks, each rank's smaller linears gain about as much
    split = [predict(run, Layout(4, 2, 1, checkpoint="selective", precision=p)).tokens_per_s
             for p in ("bf16", "float8")]
    assert split[1] > 1.1 * split[0]
    assert tensorwise.as_json()["matmuls"] == tensorwise.matmuls


def test_small_linears_stay_bf16_with_the_reason():
    run = llama3_8b(seq=64)  # 64 tokens a call: the casts and launches cost more than float8 saves
    costs, chosen = with_float8(run.costs, run.device, precision="float8", tokens=64)
    assert all(why.startswith("bf16: float8 would run it") for name, why in chosen.items() if name != "head")
    assert costs.layer_forward_s == run.costs.layer_forward_s and costs.layer_float8_parameters == 0
    # the ranking leaves out float8 layouts that run nothing in float8 (their bf16 twins are there)
    assert {p.layout.precision for p in plan_layouts(llama3_8b(seq=16, batch=4))} == {"bf16"}  # <= 64 tokens a call
    assert {p.layout.precision for p in plan_layouts(llama3_8b())} == {"bf16", "float8", "float8_rowwise"}


def test_a_device_without_float8_matmuls_refuses_float8_and_plans_bf16():
    a100 = dataclasses.replace(llama3_8b(), device=devices()["a100"])
    why = valid(a100, fsdp(precision="float8"))
    assert why and "no float8 matmuls" in why and "precision=bf16" in why
    assert {layout.precision for layout in enumerate_layouts(a100)} == {"bf16"}
    assert {layout.precision for layout in enumerate_layouts(llama3_8b())} == {"bf16", "float8", "float8_rowwise"}
    on_cpu = dataclasses.replace(a100, device=devices()["cpu"])
    assert "no float8 matmuls" in valid(on_cpu, fsdp(precision="float8_rowwise"))


def test_sharded_weights_gather_in_float8_under_tensorwise_and_in_bf16_under_rowwise():
    # 64 GPUs over 8 nodes on a slow network: the gathers, not the compute, set the step
    run = dataclasses.replace(llama3_8b(gpus=64, batch=64), device=devices()["h100"].on(NETWORKS["efa-p4d"]))
    bf16, tensorwise, rowwise = (predict(run, fsdp(64, p)) for p in ("bf16", "float8", "float8_rowwise"))
    # the units held gathered at once are the largest as gathered: here the embedding and the head, in bf16
    assert tensorwise.memory["gathered"] == bf16.memory["gathered"]
    assert rowwise.memory["gathered"] == bf16.memory["gathered"]
    # per parameter the link carries two gathers (forward, backward) and an fp32 reduce-scatter: 2 + 2 + 4
    # bytes in bf16, 1 + 1 + 4 in float8, 3/4 of them
    assert tensorwise.time["data_parallel_exposed"] < 0.85 * rowwise.time["data_parallel_exposed"]


def test_suggestions_name_float8_where_it_pays_with_the_gain():
    run = llama3_8b()
    plan = predict(run, fsdp())
    suggestions = Neighbourhood(run).suggest(plan)
    float8 = next(s for s in suggestions if s.change == "float8 matmuls (tensorwise)")
    assert float8.step_seconds_gain > 0.1 * plan.step_s and float8.addresses == "compute"
    assert "float8 matmuls (tensorwise)" in float8.describe(plan) and "step -" in float8.describe(plan)
    a100 = dataclasses.replace(run, device=devices()["a100"])
    assert not any("float8" in s.change for s in Neighbourhood(a100).suggest(predict(a100, fsdp())))


def test_picofx_plan_layout_prints_and_writes_the_precision_and_refuses_it_on_an_a100(tmp_path, capsys):
    from picofx.cli import main

    out = tmp_path / "float8.json"
    tiny = ["plan", "llama-tiny", "--seq", "32", "--global-batch", "8"]
    assert main([*tiny, "--gpu", "h100", "--layout", "dp=4,shard=true,precision=float8", "--json", str(out)]) == 0
    assert "shard x tp1 x pp1, 1 mb, float8" in capsys.readouterr().out
    plan = json.loads(out.read_text())["plans"][0]
    assert plan["precision"] == "float8" and plan["matmuls"]["head"].startswith("bf16")
    assert main([*tiny, "--gpu", "a100", "--layout", "dp=4,precision=float8_rowwise"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no float8 matmuls" in err


def test_a_float8_layouts_recipe_runs_the_precision_pass_with_its_recipe():
    from picofx.passes import Precision
    from picofx.planner.recipe import recipe

    made = recipe(fsdp(4, "float8_rowwise"), compute=["fuse", "precision"])
    assert [p.float8 for p in made.passes if isinstance(p, Precision)] == ["rowwise"]
    assert [p.float8 for p in recipe(fsdp(4, "float8"), compute=["fuse"]).passes if isinstance(p, Precision)] == \
        ["tensorwise"]
    assert "precision" in recipe(fsdp(4), compute=["fuse", "precision"]).passes
    own = Precision(float8="rowwise_with_gw_hp")  # a recipe of its own is kept
    assert [p.float8 for p in recipe(fsdp(4, "float8_rowwise"), compute=[own]).passes
            if isinstance(p, Precision)] == ["rowwise_with_gw_hp"]
