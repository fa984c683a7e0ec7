"""The data wait, memory headroom and slow-rank detectors on synthetic records: the data wait past
1% of the step advises the workers that would hide it; a slow rank is named with what made it slow;
a healthy rank, a few stalls and a GPU's CPU time raise nothing."""
import json
import random

import pytest

from picofx.diagnose import StepLog, diagnose, read_run
from picofx.diagnose.resources import data_wait, memory_headroom
from picofx.diagnose.stragglers import gather_rank_figures, stragglers


def steps(n: int = 40, *, data_s: float = 0.0, step_s: float = 0.1, workers: int = 1, device: str = "cpu",
          seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"step": s, "loss": 3.0 + rng.gauss(0, 0.02), "lr": 1e-3, "grad_norm": 1.0,
             "step_s": step_s + rng.uniform(0, 0.01), "data_s": data_s, "data_workers": workers, "device": device}
            for s in range(1, n + 1)]


def test_a_data_wait_past_one_percent_advises_workers_from_the_measured_rates():
    # prepared in the step: 30 ms of a 100 ms step; 70 ms of compute -> 1.25 x 30 / 70 -> 1 worker
    found = data_wait(steps(data_s=0.03, workers=0))
    assert found.kind == "data_wait" and "--data-workers 1" in found.advice and found.evidence["data_wait_share"] > 0.2
    # 1 worker, 60 ms waited of a ~105 ms step: a batch takes ~105 ms, the step computes ~45 ms -> 3 workers
    assert data_wait(steps(data_s=0.06, workers=1)).evidence["suggested_workers"] == 3
    assert data_wait(steps(data_s=0.06, workers=2)).evidence["suggested_workers"] == 6  # each takes twice as long
    assert "pinned memory" in data_wait(steps(data_s=0.06, device="cuda")).advice
    assert "pinned memory" not in data_wait(steps(data_s=0.06)).advice


def test_a_few_stalls_or_a_wait_under_one_percent_raise_nothing():
    assert data_wait(steps(data_s=0.0005)) is None
    stalled = steps()
    for r in stalled[10:13]:
        r["data_s"] = 0.2  # a busy machine, three times
    assert data_wait(stalled) is None
    busy = steps()
    for r in busy[::3]:
        r["data_s"] = 0.02  # a third of the steps, 20% of each: 7% in all, yet most steps found their batch ready
    assert data_wait(busy) is None
    assert diagnose(steps()) == []


def test_memory_headroom_on_a_gpu_gives_the_batch_that_fits():
    records = steps(device="cuda")
    for r in records:
        r.update(batch=8, peak_memory_bytes=10 * 2**30, memory_capacity_bytes=80 * 2**30)
    found = memory_headroom(records)
    assert found.evidence["suggested_batch"] == 57 and "--batch 57" in found.advice  # 8 x 0.9 x 80 / 10
    for r in records:
        r["peak_memory_bytes"] = 79 * 2**30
    assert "at the edge" in memory_headroom(records).seen
    assert memory_headroom(steps()) is None  # a CPU's records carry no capacity


def with_ranks(figures: list[dict], n: int = 30, seed: int = 0) -> list[dict]:
    """Records whose rank 0 line holds every rank's figures, each with a little noise."""
    rng = random.Random(seed)
    records = steps(n)
    for r in records:
        r["ranks"] = [{k: v * rng.uniform(0.95, 1.05) for k, v in f.items()} for f in figures]
    return records


HEALTHY = {"step_s": 0.30, "data_s": 0.001, "cpu_s": 0.20}


def test_a_rank_waiting_for_its_data_is_named_and_no_other():
    records = with_ranks([HEALTHY, {**HEALTHY, "data_s": 0.25}, HEALTHY, HEALTHY])
    found = stragglers(records)
    assert len(found) == 1 and found[0].evidence["rank"] == 1 and found[0].evidence["cause"] == "data"
    assert found[0].seen.startswith("rank 1 is slow (data)")
    assert "rank 1 is slow" in "\n".join(line for f in diagnose(records) for line in f.lines())


def test_a_rank_computing_longer_is_named_by_its_cpu_time_but_not_on_a_gpu():
    records = with_ranks([HEALTHY, HEALTHY, {**HEALTHY, "cpu_s": 0.6}])
    found = stragglers(records)
    assert [(f.evidence["rank"], f.evidence["cause"]) for f in found] == [(2, "compute")]
    assert found[0].evidence["excess_s"] == pytest.approx(0.3 * (1 - 0.2 / 0.6), rel=0.15)
    assert stragglers(records, device="cuda") == []


def test_a_rank_with_a_longer_step_and_nothing_else_waits_on_communication():
    found = stragglers(with_ranks([HEALTHY, {**HEALTHY, "step_s": 0.45}, HEALTHY]))
    assert [(f.evidence["rank"], f.evidence["cause"]) for f in found] == [(1, "communication or other waits")]


@pytest.mark.parametrize("seed", range(3))
def test_healthy_ranks_in_lockstep_are_never_named(seed):
    # rank 0 logs and writes the records: a little more CPU time than the others
    assert stragglers(with_ranks([{**HEALTHY, "cpu_s": 0.24}, HEALTHY], seed=seed)) == []
    assert stragglers(with_ranks([HEALTHY] * 4, seed=seed)) == []


def test_one_process_gathers_nothing():
    assert gather_rank_figures({"step_s": 1.0, "data_s": 0.0, "cpu_s": 0.5}) is None  # no process group


def test_a_metrics_file_is_read_once_per_step_the_resumed_lines_winning(tmp_path):
    lines = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "loss": 3.9}, {"step": 3, "loss": 3.8}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + '\n{"step": 4, "lo')  # cut short
    assert [(r["step"], r["loss"]) for r in read_run(tmp_path)] == [(1, 5.0), (2, 3.9), (3, 3.8)]
    (tmp_path / "other.jsonl").write_text('{"loss": 1}\n')
    with pytest.raises(ValueError, match="other.jsonl:1: a line without a step"):
        read_run(tmp_path / "other.jsonl")
    with pytest.raises(FileNotFoundError, match="without metrics.jsonl"):
        read_run(tmp_path / "..")


def test_the_step_log_keeps_the_first_and_latest_steps_with_the_runs_figures():
    log = StepLog(first=3, latest=4, run={"batch": 8})
    for s in range(1, 21):
        log.add({"step": s})
    assert [r["step"] for r in log.records] == [1, 2, 3, 17, 18, 19, 20] and log.records[0]["batch"] == 8
