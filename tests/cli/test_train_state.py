"""--save and --resume of picofx train: a resumed run goes on exactly as the saved one
would have (same losses, bit for bit), and a checkpoint holds the model under its own names."""
import importlib

import pytest
import torch

FAST = ["--backend", "eager", "--passes", "--batch", "2", "--seq", "16", "--log-every", "1"]


def load_script():
    return importlib.import_module("picofx.cli.train")


def test_two_steps_saved_then_two_resumed_equal_four_straight(tmp_path):
    train = load_script()
    straight = train.main([*FAST, "--steps", "4"])["losses"]
    first = train.main([*FAST, "--steps", "2", "--save", str(tmp_path / "run")])["losses"]
    resumed = train.main([*FAST, "--steps", "4", "--resume", str(tmp_path / "run")])["losses"]
    assert len(straight) == 4 and len(first) == 2 and len(resumed) == 2
    assert first + resumed == straight  # bit for bit: parameters, AdamW moments, lr schedule, data position
    assert len(set(straight)) == 4  # the steps differ, so a resume from the wrong step could not pass


def test_a_resume_with_other_options_or_no_steps_left_is_refused(tmp_path, capsys):
    from picofx.cli.train_args import parse_args

    train = load_script()
    train.main([*FAST, "--steps", "1", "--save", str(tmp_path / "run")])
    capsys.readouterr()
    for argv, message in [(["--steps", "3", "--batch", "4"], "(--batch 2 there, 4 here): resume with the options"),
                          (["--steps", "1"], "was saved after step 1, and --steps 1 ends there")]:
        with pytest.raises(SystemExit) as exit_:
            parse_args([*FAST, *argv, "--resume", str(tmp_path / "run")], environ={})
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_checkpoint_saved_before_it_recorded_its_layout_resumes_with_the_layout_it_ran_with(tmp_path, monkeypatch):
    """A checkpoint from before the layout record holds the layout's options instead (and, older
    still, no cp): it resumes with the layout those give, and is refused under another."""
    from picofx.cli import train, train_args

    old = {"size": "tiny", "model": "None", "batch": "2", "seq": "16", "max_positions": "None", "seed": "0",
           "data": "None", "dp": "1", "dp_replicate": "1", "pp": "1", "microbatches": "4", "shard": "False", "tp": "1",
           "sequence_parallel": "False", "async_tp": "None", "compress": "None"}
    monkeypatch.setattr(train, "run_options", lambda args, layout: old)
    train.main([*FAST, "--steps", "1", "--save", str(tmp_path / "run")])
    monkeypatch.undo()
    step, saved = train_args.saved_run(str(tmp_path / "run" / "step-1"),
                                       train_args.RUN_OPTIONS + train_args.LAYOUT_OPTIONS_BEFORE)
    assert step == 1 and saved["cp"] is None and saved["layout"] is None and saved["batch"] == "2"
    assert train_args.saved_layout(saved) == train_args.Layout()
    assert train_args.parse_args([*FAST, "--steps", "2", "--resume", str(tmp_path / "run")], environ={}).cp == 1


def test_a_checkpoint_records_its_layout_and_a_resume_under_another_is_refused_with_the_difference(tmp_path):
    from picofx.cli.train_args import Layout, layout_changes, saved_layout, saved_run, RUN_OPTIONS
    from picofx.planner.spec import layout_spec

    load_script().main([*FAST, "--steps", "1", "--save", str(tmp_path / "run")])
    _, saved = saved_run(str(tmp_path / "run" / "step-1"), RUN_OPTIONS)
    assert saved["layout"] == layout_spec(Layout()) and saved_layout(saved) == Layout()
    assert layout_changes(Layout(dp=2, shard=True), Layout(dp_replicate=2)) == [
        "layout dp_replicate=1 there, 2 here", "layout dp_shard=2 there, 1 here", "layout shard=True there, False here"]
    assert layout_changes(Layout(2, checkpoint="full"), Layout(2)) == []  # checkpointing saves the same state


def test_a_checkpoint_holds_the_model_under_its_own_names(tmp_path):
    import torch.distributed.checkpoint as dcp

    from picofx.cli import train_state
    from picofx.models.llama import CONFIGS, Llama

    train = load_script()
    train.main([*FAST, "--steps", "1", "--save", str(tmp_path / "run")])
    names = set(dcp.FileSystemReader(str(tmp_path / "run" / "step-1")).read_metadata().state_dict_metadata)
    import dataclasses

    model = Llama(dataclasses.replace(CONFIGS["tiny"], vocab_size=256))
    expected = {f"model.{name}" for name, _ in model.named_parameters()}
    assert expected <= names, sorted(expected - names)[:5]
    assert {"step", "data_replica0.generator", "rng_rank0"} <= names
    state = {f"model.{name}": torch.zeros_like(p) for name, p in model.named_parameters()}
    with train_state.single_process_quiet():
        dcp.load(state, checkpoint_id=str(tmp_path / "run" / "step-1"), no_dist=True)
    assert all(not torch.equal(v, torch.zeros_like(v)) for k, v in state.items() if "norm" not in k)
