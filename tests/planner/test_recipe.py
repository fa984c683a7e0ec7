"""The one recipe from a layout to passes and mesh: each layout kind's passes in the order picofx.optimize
runs them, and the same passes whether a plan (`picofx.plan(...).passes()`), `picofx plan --measure` or
`picofx train`'s options ask for the layout."""
from __future__ import annotations

import dataclasses

import pytest

import picofx
from picofx.cli.train_args import parse_args, picofx_passes
from picofx.cli.train_layout import run_layout, train_recipe
from picofx.passes import Checkpoint, Overlap, Pipeline, Shard, TensorParallel
from picofx.planner.layouts import Layout
from picofx.planner.recipe import describe_passes, recipe


@pytest.mark.parametrize("layout, kinds, mesh", [
    (Layout(4, 1, 1), ["fuse", Overlap], {"dp_replicate": 4}),
    (Layout(4, 1, 1, shard=True), ["fuse", Shard], {"dp_shard": 4}),
    (Layout(2, 2, 1, sequence_parallel=True), [TensorParallel, "fuse", Overlap], {"dp_replicate": 2, "tp": 2}),
    (Layout(2, 1, 2, microbatches=4), ["fuse", Pipeline, Overlap], {"pp": 2, "dp_replicate": 2}),
    (Layout(2, 2, 2, shard=True, microbatches=2), [Pipeline, TensorParallel, "fuse", Shard],
     {"pp": 2, "dp_shard": 2, "tp": 2}),
    (Layout(4, 1, 1, checkpoint=True, compress="bf16"), ["fuse", Checkpoint, Overlap], {"dp_replicate": 4}),
], ids=["dp", "shard", "tp-sp", "pp-dp", "pp-shard-tp", "ckpt-bf16"])
def test_each_layout_kind_gives_its_passes_in_the_order_optimize_needs(layout, kinds, mesh):
    made = recipe(layout, compute=["fuse"], checkpoint_budget=1 << 30)
    assert [p if isinstance(p, str) else type(p) for p in made.passes] == kinds
    assert made.mesh_shape == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1, **mesh}
    for p in made.passes:
        if isinstance(p, Pipeline):
            assert (p.stages, p.microbatches, p.schedule) == (layout.pp, layout.microbatches, layout.schedule)
        if isinstance(p, TensorParallel):
            assert p.sequence_parallel == layout.sequence_parallel
        if isinstance(p, (Overlap, Shard)):
            assert p.compress == layout.compress
        if isinstance(p, Checkpoint):
            assert p.budget == 1 << 30


TRAIN_LAYOUTS = [  # picofx train's options on 4 ranks, and the layout they give
    (["--dp", "4"], Layout(4, 1, 1)),
    (["--shard"], Layout(4, 1, 1, shard=True)),
    (["--tp", "2", "--sequence-parallel"], Layout(2, 2, 1, sequence_parallel=True)),
    (["--tp", "2", "--shard"], Layout(2, 2, 1, shard=True)),
    (["--pp", "2", "--microbatches", "4"], Layout(2, 1, 2, microbatches=4)),
    (["--tp", "2", "--pp", "2", "--microbatches", "2"], Layout(1, 2, 2, microbatches=2)),
    (["--dp", "4", "--compress", "int8"], Layout(4, 1, 1, compress="int8")),
]


@pytest.mark.parametrize("options, layout", TRAIN_LAYOUTS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_picofx_train_runs_the_plans_recipe(options, layout):
    """`picofx train` with a layout's options runs the passes a plan of that layout gives, on its mesh."""
    args = parse_args(["--passes", "fuse", "--no-measure-cuts", *options], environ={"RANK": "0", "WORLD_SIZE": "4"})
    assert run_layout(args) == layout
    planned = recipe(layout, compute=["fuse"])
    assert picofx_passes(args) == planned.passes
    assert train_recipe(args).mesh_shape == planned.mesh_shape


@pytest.mark.parametrize("layout", [Layout(4, 1, 1, shard=True, checkpoint="full", compress="int8"),
                                    Layout(2, 2, 2, shard=True, microbatches=2), Layout(2, 1, 1, shard=True, cp=4),
                                    Layout(1, 2, 2, microbatches=2, sequence_parallel=True, checkpoint="full")])
def test_the_recipe_lists_its_passes_in_the_order_the_manager_runs_them(layout):
    """No order by hand: the recipe's list is the one the passes' declarations give, stage by stage (the
    passes they require, such as tensor parallel's fuse_loss, added by the manager where they are named)."""
    from picofx.manager import resolve_passes
    from picofx.manager.order import STAGE_ORDER, run_order
    from picofx.manager.passes import pass_stage

    made = recipe(layout, compute=["precision", "fuse"], checkpoint_budget=1 << 30)
    resolved = resolve_passes(made.passes)
    ordered, moved = run_order(resolved)
    assert all(line.startswith(("given ", "  added ")) for line in (moved or "").splitlines()), moved
    assert [p for p in ordered if any(p is r for r in resolved)] == resolved, moved
    assert [STAGE_ORDER[pass_stage(p)] for p in resolved] == sorted(STAGE_ORDER[pass_stage(p)] for p in resolved)
    assert [p for p in made.passes if p in ("fuse", "precision")] == ["fuse", "precision"]  # fuse's runs_before


def test_picofx_train_keeps_its_own_options_in_the_recipe():
    args = parse_args(["--passes", "fuse", "checkpoint", "--memory-budget", "0.5", "--shard", "--compress", "int8",
                       "--compress-warmup", "3"], environ={"RANK": "0", "WORLD_SIZE": "2"})
    fuse, shard, checkpoint = picofx_passes(args)  # shard rewrites the forward graph, checkpoint the joint one
    assert fuse == "fuse" and checkpoint == Checkpoint(budget=0.5) and shard == Shard(compress="int8", warmup=3)
    args = parse_args(["--pp", "2", "--schedule", "Interleaved1F1B", "--microbatches", "4"],
                      environ={"RANK": "0", "WORLD_SIZE": "2"})
    pipeline = next(p for p in picofx_passes(args) if isinstance(p, Pipeline))
    assert (pipeline.virtual, pipeline.measure) == (2, True)


def test_a_plans_passes_and_mesh_are_the_recipes():
    plans = picofx.plan("llama-tiny", world=4, seq=32, global_batch=8, gpu="h100", say=None, checkpoint=False)
    for index, p in enumerate(plans.predictions[:20]):
        made = recipe(p.layout, compute=list(plans.compute_passes))
        assert plans.passes(index) == made.passes and plans.mesh_shape(index) == made.mesh_shape
    checkpointed = dataclasses.replace(plans.predictions[0].layout, checkpoint=True)
    (checkpoint,) = [p for p in recipe(checkpointed, checkpoint_budget=10).passes if isinstance(p, Checkpoint)]
    assert checkpoint.budget == 10


def test_the_passes_read_as_one_line():
    made = recipe(Layout(2, 2, 1, shard=True, sequence_parallel=True), compute=["fuse", "precision"])
    assert describe_passes(made.passes) == "TensorParallel(sequence_parallel=True), fuse, precision, Shard()"
