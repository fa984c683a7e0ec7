"""The measured breakdown of a step from profiler spans: each component, the unattributed remainder,
communication hidden behind compute, and the finding for exposed communication."""
import pytest

from picofx.diagnose.breakdown import COMPONENTS, Span, exposed_communication, step_breakdowns, subtract

MAIN, GLOO = 1, 7


def step_spans(offset=0.0):
    """A 100 s step (round numbers): data 0-10, forward_backward 10-70 (backward 40-70), an all-reduce
    issued at 45-46 and waited on 60-65, a blocking all-reduce 75-80 before the optimizer's 80-90,
    zero_grad 92-95."""
    s = lambda name, a, b, thread=MAIN, root=False: Span(name, offset + a, offset + b, thread, root)  # noqa: E731
    return [s("ProfilerStep*", 0, 100, root=True), s("picofx.data", 0, 10), s("aten::randint", 1, 9),
            s("picofx.forward_backward", 10, 70), s("aten::mm", 12, 38),
            s("autograd::engine::evaluate_function: CompiledFunctionBackward", 40, 70),
            s("_c10d_functional::all_reduce", 45, 46), s("_c10d_functional::wait_tensor", 60, 65),
            s("picofx.optimizer", 80, 90), s("c10d::allreduce_", 75, 80), s("Optimizer.step#AdamW.step", 80, 90),
            s("Optimizer.zero_grad#AdamW.zero_grad", 92, 95)]


def test_each_component_of_a_step_and_the_unattributed_remainder():
    (step,) = step_breakdowns(step_spans())
    assert step.seconds == 100
    # forward 10-40 (38-40 ran no op: still the forward's); backward 40-70 less the issue 45-46 and the
    # wait 60-65; optimizer from the end of forward_backward (70) to the optimizer's end, less the
    # all-reduce 75-80; outside them zero_grad 92-95 ran ops, 90-92 and 95-100 none
    assert step.parts == {"data": 10, "forward": 30, "backward": 24, "optimizer": 15, "checkpoint": 0,
                          "exposed_comm": 11, "idle": 7, "unattributed": 3}, step.parts
    assert sum(step.parts[k] for k in COMPONENTS) == pytest.approx(step.seconds)
    # in flight 45-65 (issue to the end of its wait) and 75-80 (blocking); computing in 46-60 only
    assert step.in_flight == 25 and step.hidden_comm == 14


def test_a_collective_on_another_thread_is_in_flight_and_steps_are_told_apart():
    spans = step_spans() + step_spans(offset=200.0) + [Span("gloo:all_reduce", 220, 235, GLOO, True)]
    first, second = step_breakdowns(spans)
    assert (first.step, second.step) == (0, 1)
    assert second.in_flight == 25 + 15  # gloo's thread's 220-235 is in the forward: hidden
    assert second.hidden_comm == 14 + 15 and first.hidden_comm == 14


def test_a_thread_blocked_while_a_collective_runs_on_gloos_thread_waits_for_it():
    # gloo's range 89-92: 89-90 beside the optimizer's ops (hidden); 90-92 the stepping thread runs no
    # op (a blocking all-reduce's wait, which the trace does not record): exposed, not idle
    (step,) = step_breakdowns(step_spans() + [Span("gloo:all_reduce", 89, 92, GLOO, True)])
    assert step.parts["exposed_comm"] == 11 + 2 and step.parts["idle"] == 7 - 2
    assert step.hidden_comm == 14 + 1 and step.in_flight == 25 + 3
    assert sum(step.parts[k] for k in COMPONENTS) == pytest.approx(step.seconds)


def test_time_no_range_covers_is_unattributed_or_idle_never_lost():
    spans = [Span("ProfilerStep*", 0, 10, MAIN), Span("aten::add", 2, 3, MAIN, False)]
    (step,) = step_breakdowns(spans)
    assert step.parts["unattributed"] == 1 and step.parts["idle"] == 9
    assert subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]


def record(step, exposed, hidden=0.0):
    parts = dict.fromkeys(COMPONENTS, 0.0)
    parts.update(forward=1.0 - exposed, exposed_comm=exposed)
    return {"step": step, "breakdown": [{"seconds": 1.0, **parts, "hidden_comm": hidden, "comm_in_flight": 0.5},
                                        {"seconds": 1.0, **parts, "exposed_comm": 0.0, "hidden_comm": 0.0,
                                         "comm_in_flight": 0.0}]}


def test_exposed_communication_is_a_finding_past_a_fifth_of_the_step():
    found = exposed_communication([{"step": 1}, record(2, 0.4, 0.1), record(3, 0.3, 0.1)])
    assert found.kind == "communication" and found.evidence["rank"] == 0
    assert found.evidence["exposed_share"] == pytest.approx(0.35) and "--compress" in found.advice
    assert exposed_communication([record(2, 0.1), record(3, 0.1)]) is None
    assert exposed_communication([{"step": 1, "loss": 2.0}]) is None  # no traced step: nothing said
