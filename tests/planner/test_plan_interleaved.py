"""Interleaved 1F1B as the planner prices it, against torch.distributed.pipelining's own schedule:
ScheduleInterleaved1F1B's per-rank order of forwards and backwards (built without ranks), run
with each chunk's forward and backward taking one tick and every dependency honoured, lasts
exactly the planner's slots; the one micro-batch rule accepts what torch's schedules accept and run without
deadlock, and refuses the rest; and a plan's bubble and sends follow the stages per rank."""
from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, get_schedule_class

from picofx.cost.balance import INTERLEAVED_SCHEDULES, microbatch_refusal
from picofx.planner import plan_run
from picofx.planner.layouts import Layout, pipeline_slots, predict


class ScheduledStage:
    """What a schedule reads of a stage to lay out its order: no module, no process group."""

    def __init__(self, index: int, pp: int, virtual: int):
        self.stage_index, self.group_rank, self.group_size, self.num_stages = index, 0, pp, pp * virtual
        self.is_first, self.is_last = index == 0, index == pp * virtual - 1


def ticks(order: dict, stages: int) -> int:
    """Ticks until every rank has run its actions in its order, each action one tick, a forward after
    the previous stage's, a backward after the next stage's backward and its own forward."""
    actions = {rank: [a for a in acts if a is not None and a.computation_type.value in "FB"]
               for rank, acts in order.items()}
    done, at, tick = {}, dict.fromkeys(actions, 0), 0
    while any(at[r] < len(actions[r]) for r in actions):
        ready = []
        for rank, acts in actions.items():
            if at[rank] < len(acts):
                a = acts[at[rank]]
                kind, s, i = a.computation_type.value, a.stage_index, a.microbatch_index
                needs = ([("F", s - 1, i)] if s else []) if kind == "F" else \
                    [("F", s, i)] + ([("B", s + 1, i)] if s < stages - 1 else [])
                if all(done.get(n, tick) < tick for n in needs):
                    ready.append((rank, (kind, s, i)))
        assert ready, "the schedule's order deadlocks"
        for rank, key in ready:
            done[key], at[rank] = tick, at[rank] + 1
        tick += 1
    return tick


@pytest.mark.parametrize("pp, virtual, microbatches",
                         [(4, 2, 8), (4, 2, 4), (2, 3, 4), (4, 2, 16), (8, 4, 16), (4, 1, 8), (16, 8, 16)])
def test_torchs_interleaved_order_lasts_the_planners_slots(pp, virtual, microbatches):
    stages = [ScheduledStage(pp * j, pp, virtual) for j in range(virtual)]
    order = ScheduleInterleaved1F1B(stages, microbatches).pipeline_order
    # a slot is one micro-batch's forward and backward of all the rank's stages: 2 x virtual ticks
    assert ticks(order, pp * virtual) == 2 * virtual * pipeline_slots(microbatches, pp, virtual)


@pytest.mark.parametrize("schedule, pp, virtual", [("GPipe", 4, 1), ("1F1B", 4, 1), ("Interleaved1F1B", 4, 2),
                                                   ("Interleaved1F1B", 2, 3), ("LoopedBFS", 4, 2)])
def test_the_micro_batch_rule_is_torchs(schedule, pp, virtual):
    """The rule refuses exactly the counts of micro-batches torch's schedule refuses (it accepts fewer
    than the stages where torch does); the order an accepted multi-stage schedule runs by (a single-stage
    one runs its own loop) runs to the end."""
    stages = [ScheduledStage(pp * j, pp, virtual) for j in range(virtual)]
    stages = stages if schedule in INTERLEAVED_SCHEDULES else stages[0]
    for microbatches in range(1, 3 * pp * virtual + 2):
        try:
            made = get_schedule_class(schedule)(stages, microbatches)
        except ValueError:
            made = None
        assert (microbatch_refusal(pp, microbatches, schedule) is None) == (made is not None), microbatches
        if made is not None and schedule in INTERLEAVED_SCHEDULES:
            ticks(made.pipeline_order, pp * virtual)


def test_llama_3s_sixteen_micro_batches_on_sixteen_ranks_of_eight_stages_run():
    assert microbatch_refusal(16, 16, "Interleaved1F1B") is None  # Dubey et al. 2024, 16,384 GPUs
    assert microbatch_refusal(16, 33, "Interleaved1F1B") is not None  # 2 rounds (33 // 16) do not divide 33


def test_an_interleaved_plan_has_the_bubble_over_its_stages_per_rank_and_sends_each_chunk():
    run, _ = plan_run("llama-tiny", gpus=4, gpu="h100", seq=32, global_batch=8)
    plain = predict(run, Layout(1, 1, 4, microbatches=8))
    interleaved = predict(run, dataclasses.replace(plain.layout, virtual_stages=2))
    assert interleaved.layout.schedule == "Interleaved1F1B"
    assert interleaved.time["bubble"] == pytest.approx(plain.time["bubble"] / 2, rel=0.05)
    per_slot = [p.time["pipeline_sends"] / pipeline_slots(8, 4, p.layout.virtual_stages) for p in (plain, interleaved)]
    assert per_slot[1] == pytest.approx(2 * per_slot[0])
    assert interleaved.memory["activations"] > plain.memory["activations"]  # more chunks in flight at the start
