"""picofx plan: layouts ranked by predicted step, the ones that do not fit listed with the reason."""
from __future__ import annotations

import json

import pytest

from picofx.cli import main
from picofx.cost.shard import ADAMW_STATE_BYTES
from picofx.planner import plan_run


def sound(predictions, run) -> None:
    """No plan predicts an MFU above 1, or less memory than its sharded training state needs."""
    params = run.costs.parameters
    for p in predictions:
        layout = p.layout
        state = ADAMW_STATE_BYTES * params / (layout.tp * layout.pp * (layout.dp if layout.shard else 1))
        assert 0 < p.mfu <= 1, p.layout
        assert p.memory_per_gpu >= 0.9 * state, (p.layout, p.memory_per_gpu, state)


def test_llama2_7b_on_8_h100_is_not_plain_data_parallel_which_does_not_fit():
    run, predictions = plan_run("llama2-7b", gpus=8, gpu="h100", seq=4096, global_batch=256)
    best = predictions[0]
    assert best.fits and best.memory_per_gpu <= 80e9
    assert best.layout.shard or best.layout.tp > 1 or best.layout.pp > 1
    plain = [p for p in predictions if (p.layout.tp, p.layout.pp, p.layout.shard, p.layout.checkpoint) == (1, 1, False, False)]
    assert plain and all(not p.fits and p.reason.startswith("memory: needs") for p in plain)
    assert [p.step_s for p in predictions if p.fits] == sorted(p.step_s for p in predictions if p.fits)
    sound(predictions, run)


@pytest.mark.slow
def test_llama2_70b_on_64_h100_fits_by_splitting_the_model():
    run, predictions = plan_run("llama2-70b", gpus=64, gpu="h100", seq=4096, global_batch=512)
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
