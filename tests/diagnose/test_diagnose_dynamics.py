"""The loss-trend detectors on synthetic per-step records: a learning rate far too high is flagged
with a lower one reasoned from where the loss was lowest; non-finite losses, spikes after the
warm-up and a plateau are told apart; a noisy healthy run raises nothing."""
import math
import random

import pytest

from picofx.diagnose import diagnose, what_to_change
from picofx.diagnose.dynamics import spike_steps, warmup_end

WARMUP, PEAK = 20, 3e-3


def lr_at(step: int, peak: float = PEAK) -> float:
    return peak * min(1.0, step / WARMUP)  # picofx train's warm-up


def healthy(steps: int = 200, seed: int = 0, noise: float = 0.05) -> list[dict]:
    """A loss falling from 5.5 towards 2.3 with batch noise, the gradient norm falling too."""
    rng = random.Random(seed)
    return [{"step": s, "loss": 2.3 + 3.2 * math.exp(-s / 40) + rng.gauss(0, noise), "lr": lr_at(s),
             "grad_norm": 1.0 + 3 * math.exp(-s / 30) + abs(rng.gauss(0, 0.1))} for s in range(1, steps + 1)]


def too_high_lr(steps: int = 50, seed: int = 1) -> list[dict]:
    """As the tiny model at --lr 1: the loss falls at first, then climbs past the first step's while the
    lr warms up, noisily, and the gradient norm grows."""
    rng = random.Random(seed)
    records = []
    for s in range(1, steps + 1):
        lr = lr_at(s, 1.0)
        loss = 5.6 - 1.5 * min(s, 3) / 3 + max(0, s - 3) * 0.15 + rng.gauss(0, 0.8)
        records.append({"step": s, "loss": loss, "lr": lr, "grad_norm": 4 + 0.3 * max(0, s - 3) + rng.gauss(0, 1)})
    return records


@pytest.mark.parametrize("seed", range(5))
def test_a_healthy_noisy_run_raises_nothing(seed):
    records = healthy(seed=seed)
    assert diagnose(records) == [] and what_to_change(diagnose(records)) == []


def test_a_far_too_high_learning_rate_is_flagged_within_fifty_steps_with_a_lower_one():
    records = too_high_lr()
    found = diagnose(records)
    assert [f.kind for f in found] == ["divergence"]
    suggested = found[0].evidence["suggested_lr"]
    best = found[0].evidence["best_step"]
    assert best <= 10 and suggested == pytest.approx(lr_at(best, 1.0) / 2)  # half the lr the loss was lowest at
    assert "lower the learning rate to" in found[0].advice and found[0].evidence["gradient_growth"] > 1.5
    assert diagnose(too_high_lr(steps=25))[0].kind == "divergence"  # already half-way through


def test_a_rising_loss_with_a_steady_gradient_norm_is_no_divergence():
    records = too_high_lr()
    for r in records:
        r["grad_norm"] = 4.0
    assert all(f.kind != "divergence" for f in diagnose(records))


def test_a_non_finite_loss_is_a_divergence_from_its_step():
    records = healthy(60)
    records[40]["loss"] = float("nan")
    records[41]["loss"] = None  # as a --metrics line writes it
    found = diagnose(records)
    assert found[0].kind == "divergence" and found[0].steps == (41, 60) and found[0].confidence >= 0.9


def test_a_constant_lr_that_diverges_is_cut_to_a_third():
    records = too_high_lr()
    for r in records:
        r["lr"] = 0.5
    assert diagnose(records)[0].evidence["suggested_lr"] == pytest.approx(0.5 / 3)


def test_a_spike_well_past_the_warm_up_is_a_loss_spike_and_names_its_step():
    records = healthy()
    records[149]["loss"] *= 1.6
    assert [records[i]["step"] for i in spike_steps(records)] == [150]
    found = diagnose(records)
    assert [f.kind for f in found] == ["loss_spikes"] and found[0].steps == (150, 150)


def test_spikes_right_after_the_warm_up_advise_a_longer_one():
    records = healthy()
    for step in (24, 31):
        records[step - 1]["loss"] *= 1.5
    assert warmup_end(records) == WARMUP
    found = diagnose(records)
    assert [f.kind for f in found] == ["warmup"] and "over 40 steps" in found[0].advice


def test_a_flat_loss_over_the_last_steps_is_a_plateau():
    records = healthy(100)
    rng = random.Random(3)
    records += [{"step": s, "loss": records[-1]["loss"] + rng.gauss(0, 0.01), "lr": PEAK, "grad_norm": 1.0}
                for s in range(101, 201)]
    found = diagnose(records)
    assert [f.kind for f in found] == ["plateau"] and "decay the learning rate" in found[0].advice
    assert diagnose(records[:99]) == []  # too short a run to call it


def test_every_finding_carries_its_evidence_and_prints_as_a_block():
    found = diagnose(too_high_lr())
    block = what_to_change(found)
    assert block[0] == "what to change:" and any("change: lower the learning rate" in line for line in block)
    for f in found:
        assert f.steps[0] <= f.steps[1] and 0 < f.confidence <= 1 and f.effect and f.evidence
        assert f.as_dict()["kind"] == f.kind


def test_a_loss_too_noisy_to_tell_a_slow_descent_from_a_plateau_is_not_called_one():
    rng = random.Random(4)
    records = [{"step": s, "loss": 3.0 - 0.001 * s + rng.gauss(0, 0.3), "lr": PEAK, "grad_norm": 1.0}
               for s in range(1, 201)]
    assert diagnose(records) == []
