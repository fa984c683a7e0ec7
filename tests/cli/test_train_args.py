"""picofx train's options as it resolves them: the layout under torchrun, and the
checkpoint pass built on --memory-budget."""
import pytest

import picofx
from picofx.cli.train_args import parse_args, picofx_passes
from picofx.cli.train_layout import train_recipe

TORCHRUN_4 = {"RANK": "0", "WORLD_SIZE": "4"}


@pytest.mark.parametrize("argv, dp, pp", [([], 4, 1), (["--pp", "2"], 2, 2), (["--pp", "4"], 1, 4),
                                          (["--dp", "2", "--pp", "2"], 2, 2)])
def test_under_torchrun_the_replicas_default_to_the_ranks_the_pipeline_leaves(argv, dp, pp):
    args = parse_args(argv, environ=TORCHRUN_4)
    assert (args.dp, args.pp, args.world) == (dp, pp, 4)
    assert args.dp_default == ("--dp" not in argv)


@pytest.mark.parametrize("argv, dp, pp", [(["--tp", "2", "--shard"], 2, 1), (["--tp", "2", "--pp", "2"], 1, 2)])
def test_tensor_parallel_composes_with_shard_and_pipeline_on_four_ranks(argv, dp, pp):
    args = parse_args(argv, environ=TORCHRUN_4)
    assert (args.dp, args.pp, args.tp, args.world) == (dp, pp, 2, 4)


def test_pipeline_times_shard_times_tensor_parallel_on_eight_ranks():
    args = parse_args(["--tp", "2", "--pp", "2", "--shard"], environ={"RANK": "0", "WORLD_SIZE": "8"})
    assert (args.dp, args.pp, args.tp, args.world) == (2, 2, 2, 8)
    args = parse_args(["--tp", "2", "--pp", "2", "--dp", "2"], environ={"RANK": "0", "WORLD_SIZE": "8"})
    assert (args.dp, args.shard) == (2, False)  # replicated data parallelism over tensor-parallel stages


def test_hsdp_is_replicas_of_a_sharded_group():
    args = parse_args(["--shard", "--dp-replicate", "2", "--passes"], environ=TORCHRUN_4)
    assert (args.dp, args.dp_replicate, args.world) == (2, 2, 4)
    made = train_recipe(args)
    assert made.mesh_shape == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 1}
    assert [type(p).__name__ for p in made.passes] == ["Shard"]


@pytest.mark.parametrize("argv, chunked", [(["--sequence-parallel"], True), (["--sequence-parallel", "--async-tp"], True),
                                           (["--sequence-parallel", "--no-async-tp"], False)])
def test_async_tp_chunks_the_sequence_parallel_exchanges(argv, chunked):
    args = parse_args(["--tp", "2", "--passes", *argv], environ={"RANK": "0", "WORLD_SIZE": "2"})
    (tp,) = train_recipe(args).passes
    assert tp.sequence_parallel and tp.async_overlap == chunked


def test_compress_names_overlap_s_compressor_for_the_replicas():
    args = parse_args(["--compress", "topk:0.01"], environ=TORCHRUN_4)
    assert (args.dp, args.compress) == (4, "topk:0.01")


def test_compress_under_shard_names_shard_s_compressor():
    args = parse_args(["--shard", "--compress", "int8"], environ=TORCHRUN_4)
    assert (args.dp, args.shard, args.compress) == (4, True, "int8")


@pytest.mark.parametrize("stage", [1, 2])
def test_shard_stage_reaches_the_shard_pass_beside_a_pipeline(stage):
    args = parse_args(["--shard", "--shard-stage", str(stage), "--pp", "2", "--passes"], environ=TORCHRUN_4)
    made = train_recipe(args)
    assert made.mesh_shape["dp_shard"] == 2
    assert [getattr(p, "stage", None) for p in made.passes if type(p).__name__ == "Shard"] == [stage]


def test_compress_warmup_counts_steps_before_the_compressor():
    args = parse_args(["--shard", "--compress", "topk:0.01", "--compress-warmup", "40"], environ=TORCHRUN_4)
    assert (args.compress, args.compress_warmup) == ("topk:0.01", 40)
    assert parse_args(["--compress", "int8"], environ=TORCHRUN_4).compress_warmup == 0


def test_one_process_is_one_replica():
    args = parse_args([], environ={})
    assert (args.dp, args.pp, args.world, args.dp_default) == (1, 1, 1, False)


@pytest.mark.parametrize("argv, message", [
    (["--pp", "3"], "--pp 3 does not divide the 4 ranks"),
    (["--dp", "3"], "the layout --dp 3 x --tp 1 x --pp 1 is 3 ranks, but torchrun started 4"),
    (["--tp", "2", "--pp", "2", "--dp", "2"],
     "the layout --dp 2 x --tp 2 x --pp 2 is 8 ranks, but torchrun started 4"),
    (["--shard", "--dp-replicate", "2", "--compress", "int8"], "HSDP's all-reduce across the replicas is not compressed"),
    (["--dp-replicate", "2"], "--dp-replicate 2 is HSDP's replicas of a sharded group: add --shard"),
    (["--tp", "2", "--no-async-tp"], "--async-tp overlaps the gathers and reduce-scatters of --sequence-parallel"),
    (["--sequence-parallel"], "--sequence-parallel splits the sequence over the --tp ranks"),
    (["--tp", "4", "--compress", "int8"], "--compress compresses the data-parallel ranks' gradient all-reduce"),
    (["--compress", "int9"], "'int9' is not a compressor"),
    (["--compress-warmup", "5"], "--compress-warmup counts steps before --compress's compressor starts"),
    (["--shard-stage", "1"], "--shard-stage 1 says what --shard shards: add --shard"),
    (["--pp", "4", "--microbatches", "2"], "--pp 4 --microbatches 2 --passes fuse --schedule 1F1B: 2 micro-batches are fewer than the 4 pipeline stages"),
    (["--pp", "2", "--batch", "6"], "--batch 6 does not split into --microbatches 4"),
    (["--pp", "2", "--schedule", "Interleaved1F1B", "--microbatches", "5", "--batch", "10"],
     "5 is not a whole number of rounds; 4 is"),
])
def test_a_layout_that_cannot_run_is_refused_before_the_process_group(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv, environ=TORCHRUN_4)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_context_parallel_beside_hsdp_runs_the_shard_pass_on_all_three_dimensions():
    from picofx.cli.train_layout import train_recipe
    from picofx.passes import ContextParallel, Shard

    args = parse_args(["--cp", "2", "--cp-method", "ring", "--shard", "--dp", "2", "--dp-replicate", "2"],
                      environ={"RANK": "0", "WORLD_SIZE": "8"})
    made = train_recipe(args)
    assert {k: v for k, v in made.mesh_shape.items() if v > 1} == {"dp_replicate": 2, "dp_shard": 2, "cp": 2}
    assert any(isinstance(p, Shard) for p in made.passes)
    assert [p.method for p in made.passes if isinstance(p, ContextParallel)] == ["ring"]


def test_only_rank_0_prints_a_refused_option(capsys):
    for rank, printed in (("0", True), ("1", False)):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--dp", "3"], environ={"RANK": rank, "WORLD_SIZE": "4"})
        assert exit_.value.code == 2 and bool(capsys.readouterr().err) == printed, rank


@pytest.mark.parametrize("text, budget", [("2GiB", "2GiB"), ("1000000", 1_000_000), ("0.5", 0.5)])
def test_memory_budget_becomes_the_checkpoint_pass_budget(text, budget):
    args = parse_args(["--passes", "fuse", "checkpoint", "--memory-budget", text], environ={})
    fuse, checkpoint = picofx_passes(args)
    assert fuse == "fuse" and checkpoint == picofx.passes.Checkpoint(budget=budget)
    assert picofx_passes(parse_args(["--passes", "checkpoint"], environ={})) == ["checkpoint"]


def test_shard_in_one_process_says_how_to_launch_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--shard"], environ={})
    assert exit_.value.code == 2 and "--shard runs one process per rank: launch it with torchrun" in capsys.readouterr().err


def test_compress_in_one_process_is_refused_with_how_to_launch_it(capsys):
    for argv in (["--compress", "int8"], ["--layout", "auto", "--compress", "bf16"]):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv, environ={})
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
        assert "one process has none: it needs --dp or --shard under torchrun" in err
