"""Context parallelism in the planner: cp layouts where the sequence is long or nothing else fits,
activations and compute per rank falling by 1/cp, the K/V exchange and the gradients over dp x cp,
cp in --layout specs (refused where the sequence does not split), the "more cp" / "less cp"
neighbours, and the recipe and picofx train's view of a cp layout."""
from __future__ import annotations

import dataclasses

import pytest

from picofx.cli import main
from picofx.cost.device import devices
from picofx.passes import ContextParallel
from picofx.planner import plan_run
from picofx.planner.context import LONG_SEQUENCE, gathered_kv_bytes, gathered_kv_kept
from picofx.planner.costs import ModelCosts
from picofx.planner.layouts import Layout, Run, predict, valid
from picofx.planner.search import enumerate_layouts, plan_layouts
from picofx.planner.models import model_config, parameter_count
from picofx.planner.recipe import recipe
from picofx.planner.spec import parse_layout
from picofx.planner.suggest import Neighbourhood

SEQ = 40  # splits into 2 x cp chunks for cp 2 and 4, not 8


def synthetic(gpus: int, global_batch: int = 1, memory: int | None = None, seq: int = SEQ) -> Run:
    """llama-tiny's shape with layer costs in milliseconds and no per-call terms: compute scales with tokens alone."""
    config = model_config("llama-tiny")
    costs = ModelCosts(config, seq, 1e-3, 2e-3, 4 * 10**8, 1e-3, 2e-3, 10**8, 10**8, parameter_count(config), 1e6)
    gpu = devices()["h100"] if memory is None else dataclasses.replace(devices()["h100"], memory_capacity=memory)
    return Run(costs, gpu, gpus, 8, global_batch)


def test_cp_is_enumerated_only_where_it_splits_the_sequence_and_the_gpus():
    run = synthetic(8, global_batch=8)
    without = enumerate_layouts(run)
    assert {layout.cp for layout in without} == {1}
    layouts = enumerate_layouts(run, context=True)
    assert {layout.cp for layout in layouts} == {1, 2, 4}  # 40 tokens do not split into 16 chunks
    assert all(layout.gpus == 8 and valid(run, layout) is None for layout in layouts)
    assert {(layout.dp, layout.tp, layout.pp) for layout in layouts if layout.cp == 4} == {(2, 1, 1), (1, 2, 1),
                                                                                        (1, 1, 2)}
    assert any(layout.cp == 2 and layout.dp == 1 and layout.shard for layout in layouts)  # shard over the cp ranks
    assert not any(layout.cp > 1 and layout.compress for layout in enumerate_layouts(run, ("bf16",), context=True))


def test_plans_consider_cp_for_long_sequences_or_where_nothing_else_fits():
    assert {p.layout.cp for p in plan_layouts(synthetic(4, 4))} == {1}  # short, and layouts without cp fit
    assert {p.layout.cp for p in plan_layouts(synthetic(4, 4, seq=LONG_SEQUENCE))} == {1, 2, 4}
    without = plan_layouts(synthetic(4, 2))
    assert {p.layout.cp for p in without} == {1}
    budget = int(min(p.memory_per_gpu for p in without) * 0.9 / 0.95)  # below the least a layout without cp needs
    plans = plan_layouts(synthetic(4, 2, memory=budget))
    assert plans[0].fits and plans[0].layout.cp > 1
    assert not any(p.fits for p in plans if p.layout.cp == 1)
    # one sequence over 4 GPUs of llama-tiny's 2 kv heads: only cp gives the ranks work
    assert not enumerate_layouts(synthetic(4, 1)) and {p.layout.cp for p in plan_layouts(synthetic(4, 1))} == {2, 4}


def test_activations_per_rank_fall_by_cp_beside_the_gathered_keys_and_values():
    one = predict(synthetic(1), Layout(1, 1, 1))
    config = model_config("llama-tiny")
    for cp in (2, 4):
        split = predict(synthetic(cp), Layout(1, 1, 1, cp=cp))
        kv = gathered_kv_kept(config, SEQ, 1, config.num_hidden_layers, 1, cp)
        assert kv == pytest.approx(config.num_hidden_layers * gathered_kv_bytes(config, SEQ, 1) * (1 - 1 / cp)
                                   + gathered_kv_bytes(config, SEQ, 1))
        assert split.memory["activations"] == pytest.approx(one.memory["activations"] / cp + kv, rel=1e-6)
        assert split.memory["activations"] <= 0.6 * one.memory["activations"] * 2 / cp
        assert split.time["compute"] == pytest.approx(one.time["compute"] / cp)  # each rank's share of the tokens
        assert split.time["context_parallel_comm"] > 0 and one.time["context_parallel_comm"] == 0
        assert sum(split.time.values()) == pytest.approx(split.step_s)


def test_full_checkpointing_gathers_again_and_sharding_spans_dp_times_cp():
    run = synthetic(8, global_batch=2)
    plain = predict(run, Layout(2, 1, 1, shard=True, cp=4))
    full = predict(run, Layout(2, 1, 1, shard=True, cp=4, checkpoint="full"))
    assert full.time["context_parallel_comm"] > plain.time["context_parallel_comm"]  # the recompute's all-gathers
    sharded_dp = predict(synthetic(8, global_batch=8), Layout(8, 1, 1, shard=True))
    assert plain.memory["states"] == sharded_dp.memory["states"]  # states over dp_shard x cp = 8 ranks either way
    replicated = predict(run, Layout(2, 1, 1, cp=4))
    assert replicated.memory["states"] == 8 * plain.memory["states"]
    assert replicated.time["data_parallel_exposed"] >= 0


def test_a_spec_spells_cp():
    assert parse_layout("dp=1,shard=true,cp=8,tp=1,pp=1,checkpoint=full") == \
        Layout(1, 1, 1, shard=True, checkpoint="full", cp=8)
    assert parse_layout("shard=true,cp=4", gpus=8) == Layout(2, 1, 1, shard=True, cp=4)
    with pytest.raises(ValueError, match="cp='0': a whole number of at least 1"):
        parse_layout("cp=0")


TINY = ["plan", "llama-tiny", "--gpu", "h100", "--global-batch", "4"]


def test_a_spec_whose_sequence_does_not_split_into_2_cp_chunks_is_refused(capsys):
    assert main([*TINY, "--seq", "36", "--layout", "shard=true,cp=8"]) == 2
    err = capsys.readouterr().err
    assert "cp 8 splits each sequence into 2 x 8 = 16 chunks" in err and "36 tokens do not divide by 16" in err
    assert "make the sequence a multiple of 16" in err
    assert main([*TINY, "--seq", "32", "--gpus", "4", "--layout", "shard=true,cp=8"]) == 2
    assert "is 8 GPUs (dp x tp x pp x cp), --gpus 4" in capsys.readouterr().err


def test_a_cp_layout_is_predicted_with_its_fields_in_the_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*TINY, "--seq", "32", "--layout", "dp=1,shard=true,cp=4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dp1 shard x tp1 x pp1 x cp4" in text
    import json

    plan = json.loads(out.read_text())["plans"][0]
    assert plan["cp"] == 4 and plan["dp"] == 1 and "context_parallel_comm" in plan["time"]
    assert json.loads(out.read_text())["recipe"]["mesh"]["cp"] == 4


def test_more_and_less_cp_are_neighbours_and_more_cp_is_suggested_where_only_it_fits():
    run = synthetic(8, global_batch=8)
    hood = Neighbourhood(run)
    changes = {what: p.layout for what, p in hood.neighbours(Layout(4, 1, 1, shard=True, cp=2))}
    assert (changes["more cp: cp 4"].cp, changes["more cp: cp 4"].dp) == (4, 2)
    assert (changes["less cp: cp 1"].cp, changes["less cp: cp 1"].dp) == (1, 8)
    one_replica = dict(Neighbourhood(synthetic(4, global_batch=8)).neighbours(Layout(1, 2, 1, shard=True, cp=2)))
    assert one_replica["more cp: cp 4, tp 1"].layout == Layout(1, 1, 1, shard=True, cp=4)  # no dp to give: tp's ranks
    # a budget only a quarter of a sequence per rank fits: cp 4 with 4 micro-batches of one sequence
    quarter = predict(run, Layout(2, 1, 1, shard=True, cp=4, microbatches=4))
    tight = synthetic(8, global_batch=8, memory=int(quarter.memory_per_gpu / 0.95 * 1.001))
    plan = predict(tight, Layout(4, 1, 1, shard=True, cp=2, microbatches=2))
    assert not plan.fits
    suggested = Neighbourhood(tight).suggest(plan)
    more = [s for s in suggested if s.change.startswith("more cp: cp 4")]
    assert more and more[0].layout.microbatches == 4 and more[0].memory_bytes_gain > 0, suggested


def test_the_recipe_runs_cp_as_the_pass_and_mesh_dimension():
    made = recipe(Layout(2, 1, 1, shard=True, cp=4, checkpoint="full"))
    assert isinstance(made.passes[0], ContextParallel)
    assert made.mesh_shape == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1, "cp": 4}
    assert "cp" not in recipe(Layout(2, 1, 1)).mesh_shape


@pytest.mark.slow
def test_llama3_8b_at_131072_tokens_on_8_h100_plans_cp():
    run, plans = plan_run("llama3.1-8b", gpus=8, gpu="h100-96gb", seq=131072, global_batch=2)
    assert plans[0].fits and plans[0].layout.cp > 1
    assert not any(p.fits for p in plans if p.layout.cp == 1 and p.layout.tp < 4)  # without cp: tp 4 or 8
    hood = Neighbourhood(run, predictions=plans)
    less = [p.layout for what, p in hood.neighbours(Layout(1, 1, 1, shard=True, cp=8, checkpoint="full",
                                                           microbatches=2)) if what.startswith("less cp: cp 4")]
    assert [(layout.dp, layout.cp) for layout in less] == [(2, 4)]


def test_the_html_report_labels_a_plan_with_its_cp():
    from picofx.report_html.plans import plan_label

    plan = predict(synthetic(8, 1, seq=64), Layout(1, 1, 1, shard=True, cp=8, checkpoint="full")).as_json()
    assert plan_label(plan) == Layout(1, 1, 1, shard=True, cp=8, checkpoint="full").describe()
    assert "cp" not in plan_label(predict(synthetic(8, 8), Layout(8, 1, 1)).as_json())



def test_picofx_train_with_cp_runs_the_plans_recipe():
    """`picofx train --shard --cp 2` on 4 ranks is the plan's layout dp 2 shard x cp 2, its passes and mesh."""
    from picofx.cli.train_args import parse_args, picofx_passes
    from picofx.cli.train_layout import run_layout, train_recipe

    args = parse_args(["--passes", "fuse", "--no-measure-cuts", "--shard", "--cp", "2"],
                      environ={"RANK": "0", "WORLD_SIZE": "4"})
    layout = Layout(2, 1, 1, shard=True, cp=2)
    assert run_layout(args) == layout
    planned = recipe(layout, compute=["fuse"])
    assert picofx_passes(args) == planned.passes and isinstance(planned.passes[0], ContextParallel)
    assert train_recipe(args).mesh_shape == planned.mesh_shape == {"pp": 1, "dp_replicate": 1, "dp_shard": 2,
                                                                   "tp": 1, "cp": 2}


def test_picofx_train_sees_a_planned_cp_layout_as_context_parallel():
    from picofx.cli.train_layout import unrunnable
    from picofx.manager.combinations import features_of

    made = recipe(Layout(2, 1, 1, shard=True, cp=2))
    assert "context_parallel" in features_of(made.passes, made.mesh_shape)
    assert unrunnable(Layout(2, 1, 1, shard=True, cp=2)) is None
