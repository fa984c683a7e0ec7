"""picofx plan: layouts ranked by predicted step, the ones that do not fit listed with the reason."""
from __future__ import annotations

import json

import pytest

import dataclasses

import picofx
from picofx.cli import main
from picofx.cost.device import devices
from picofx.cost.shard import ADAMW_STATE_BYTES
from picofx.planner import plan_run
from picofx.planner.costs import ModelCosts
from picofx.planner.layouts import MAX_MEMORY_FRACTION, Layout, Run, predict
from picofx.planner.models import model_config, parameter_count


def sound(predictions, run) -> None:
    """No plan predicts an MFU above 1, or less memory than its sharded training state needs."""
    params = run.costs.parameters
    for p in predictions:
        layout = p.layout
        state = ADAMW_STATE_BYTES * params / (layout.tp * layout.pp * (layout.dp if layout.shard else 1))
        assert 0 < p.mfu <= 1, p.layout
        assert p.memory_per_gpu >= 0.9 * state, (p.layout, p.memory_per_gpu, state)


def test_llama2_7b_on_8_h100_is_not_plain_data_parallel_which_does_not_fit(llama2_7b_on_8_h100):
    run, predictions = llama2_7b_on_8_h100
    best = predictions[0]
    assert best.fits and best.memory_per_gpu <= 80e9
    assert best.layout.shard or best.layout.tp > 1 or best.layout.pp > 1
    plain = [p for p in predictions
             if (p.layout.tp, p.layout.pp, p.layout.shard) == (1, 1, False) and not p.layout.checkpoint]
    assert plain and all(not p.fits and p.reason.startswith("memory: needs") for p in plain)
    assert [p.step_s for p in predictions if p.fits] == sorted(p.step_s for p in predictions if p.fits)
    sound(predictions, run)


@pytest.mark.slow
def test_llama2_70b_on_64_h100_fits_by_splitting_the_model(llama2_70b_on_64_h100):
    run, predictions = llama2_70b_on_64_h100
    best = predictions[0]
    assert best.fits and (best.layout.shard or best.layout.tp * best.layout.pp > 1)
    sound(predictions, run)


def test_the_command_prints_a_table_and_writes_every_plan_as_json(tmp_path, capsys):
    out = tmp_path / "plans.json"
    assert main(["plan", "llama-tiny", "--gpus", "4", "--gpu", "cpu", "--seq", "64", "--global-batch", "8",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bottleneck" in printed and "layouts" in printed
    data = json.loads(out.read_text())
    assert data["best"] == 0 and data["plans"][0]["fits"]
    keys = {"dp", "tp", "pp", "shard", "microbatches", "schedule", "checkpoint", "compress", "memory_per_gpu",
            "step_s", "tokens_per_s", "mfu", "fits", "bottleneck", "suggestions", "measured_step_s"}
    assert keys <= set(data["plans"][0])
    assert {(p["dp"] * p["tp"] * p["pp"]) for p in data["plans"]} == {4}
    suggestion = {"change", "addresses", "step_seconds_gain", "memory_bytes_gain", "layout"}
    assert all(p["suggestions"] and set(p["suggestions"][0]) == suggestion for p in data["plans"])
    assert printed.count("  -> ") == min(10, len(data["plans"]))  # each row's best suggestion
    best = data["plans"][0]
    assert data["recipe"]["mesh"] == {"pp": best["pp"], "tp": best["tp"],
                                      "dp_replicate": 1 if best["shard"] else best["dp"],
                                      "dp_shard": best["dp"] if best["shard"] else 1}
    assert f"plan 0 runs as passes [{data['recipe']['passes']}]" in printed


def test_bad_input_is_one_line_and_status_2(capsys):
    assert main(["plan", "llama-huge", "--gpus", "8", "--global-batch", "8"]) == 2
    assert "unknown model 'llama-huge'" in capsys.readouterr().err


@pytest.mark.slow
def test_measure_runs_the_top_plans_on_gloo_ranks_and_prints_predicted_against_measured(tmp_path, capsys):
    out = tmp_path / "plans.json"
    assert main(["plan", "llama-tiny", "--gpus", "2", "--gpu", "cpu", "--seq", "32", "--global-batch", "4",
                 "--measure", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "predicted s" in printed and "measured s" in printed and "calibrated:" in printed
    measured = [p for p in json.loads(out.read_text())["plans"] if p["measured_step_s"] is not None]
    assert len(measured) >= 3 and all(p["measured_step_s"] > 0 for p in measured)


def test_a_plan_that_does_not_fit_names_the_headroom_the_planner_keeps():
    """A step that needs less than the GPU has, but more than the planner lets it use."""
    config = model_config("llama-tiny")
    costs = ModelCosts(config, 32, 1e-3, 2e-3, 4 * 10**9, 1e-3, 2e-3, 10**8, 10**8, parameter_count(config), 1e6)
    layout = Layout(4, 1, 1)
    needs = predict(Run(costs, devices()["h100"], 4, 4, 8), layout).memory_per_gpu
    gpu = dataclasses.replace(devices()["h100"], memory_capacity=int(needs / (MAX_MEMORY_FRACTION + 0.02)))
    p = predict(Run(costs, gpu, 4, 4, 8), layout)
    assert needs < gpu.memory_capacity and not p.fits
    usable = gpu.memory_capacity * MAX_MEMORY_FRACTION
    assert p.reason == (f"memory: needs {needs / 1e9:.1f} GB per GPU of the {usable / 1e9:.1f} GB usable "
                        f"({MAX_MEMORY_FRACTION:.0%} of the {gpu.name}'s {gpu.memory_capacity / 1e9:.1f} GB; the rest "
                        "kept for the allocator and fragmentation)")


def test_a_sequence_past_the_models_positions_is_refused(capsys):
    assert main(["plan", "llama2-7b", "--gpus", "8", "--seq", "100000", "--global-batch", "256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "100,000 tokens" in err and "llama2-7b's 4,096 positions" in err
    assert "at most 4,096 tokens" in err
    with pytest.raises(ValueError, match="4,096 positions"):
        picofx.plan("llama2-7b", world=8, seq=100_000, global_batch=256, gpu="h100")


def test_no_gpus_is_refused_naming_gpus_not_the_batch(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["plan", "llama-tiny", "--gpus", "0", "--global-batch", "8"])
    err = capsys.readouterr().err
    error = err.splitlines()[-1]
    assert stop.value.code == 2 and error == "picofx plan: error: argument --gpus: must be at least 1, got 0"
    with pytest.raises(ValueError, match="the number of GPUs must be at least 1, got 0"):
        picofx.plan("llama-tiny", world=0, seq=32, global_batch=8, gpu="h100")
