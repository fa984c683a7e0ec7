"""picofx plan --show stages|buckets: what tools/plan_pipeline.py and tools/plan_dp.py printed, for the
best pipelined and the best replicated plan."""
from __future__ import annotations

import json

from picofx.cli import main


def test_show_stages_and_buckets_print_and_write_the_whole_model_analysis(tmp_path, capsys):
    out = tmp_path / "plans.json"
    assert main(["plan", "llama-tiny", "--gpus", "4", "--gpu", "h100", "--seq", "32", "--global-batch", "8",
                 "--top", "1", "--show", "stages", "buckets", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pipeline stages of dp2 x tp1 x pp2" in printed and "stages begin at: embedding" in printed
    assert "gradient buckets of dp4 x tp1 x pp1" in printed and "overlapped in bf16" in printed
    data = json.loads(out.read_text())

    rows = {(r["schedule"], r["cuts"]): r for r in data["stages"]}
    assert {"GPipe", "1F1B", "Interleaved1F1B"} == {schedule for schedule, _ in rows}
    one_f_one_b = rows[("1F1B", "uniform layers")]
    assert len(one_f_one_b["peak_bytes_per_gpu"]) == 2 and one_f_one_b["stage_starts"][0] == "embedding"
    assert rows[("Interleaved1F1B", "cost-balanced")]["bubble"] < one_f_one_b["bubble"]  # 4 stages on 2 GPUs

    buckets = data["buckets"]
    assert buckets["buckets"] and sum(b["bytes"] for b in buckets["buckets"]) > 0
    assert buckets["exposed_overlap_bf16_s"] <= buckets["exposed_overlap_s"] <= buckets["exposed_after_backward_s"]
    assert buckets["compute_s"] > buckets["backward_s"] > 0


def test_show_says_when_no_plan_is_of_its_kind(capsys):
    assert main(["plan", "llama-tiny", "--gpus", "1", "--gpu", "h100", "--seq", "32", "--global-batch", "2",
                 "--top", "1", "--show", "stages", "buckets"]) == 0
    printed = capsys.readouterr().out
    assert "stages: no plan is pipelined" in printed
    assert "buckets: no plan is replicated data parallel of whole models" in printed
