"""picofx.profile on 2 gloo ranks (one spawned group): each collective's time in flight comes from
gloo's worker threads, a blocking collective's untraced wait is exposed communication and an
asynchronous one behind compute is hidden, the parts still add up to the step; and the link rates
fitted from the traced collectives are what picofx.plan then prices communication with."""
import dataclasses
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "passes"))  # the rank harness, beside the pass tests
from spawn_ranks import run_scenarios  # noqa: E402

from picofx.diagnose.breakdown import COMPONENTS  # noqa: E402
from picofx.diagnose.collectives import fastest_of_ranks, link_rates  # noqa: E402

GRADIENT_NUMEL = 1 << 20  # 4 MiB of fp32: an all-reduce long enough to see on loopback


def traced_collectives(rank: int, world: int, folder: str) -> tuple:
    """2 traced steps: an all-reduce issued asynchronously behind matmuls (then waited on), a blocking
    one and a one-element one in the optimizer phase. Each step's breakdown and the collectives seen."""
    import torch
    import torch.distributed as dist

    import picofx

    torch.set_num_threads(1)
    weight, grads = torch.randn(256, 256) / 16, torch.ones(GRADIENT_NUMEL)
    with picofx.profile(steps=2, wait=0, warmup=1, directory=folder, shapes=True) as prof:
        for _ in range(3):
            with prof.phase("forward_backward"):
                x = weight
                work = dist.all_reduce(grads, async_op=True)
                for _ in range(40):
                    x = torch.tanh(x @ weight)
                work.wait()
            with prof.phase("optimizer"):
                dist.all_reduce(grads)  # the thread blocks; the trace records no op while it waits
                dist.all_reduce(torch.ones(1))
            prof.step()
    return [b.as_dict() for b in prof.breakdowns], prof.collectives, str(prof.trace)


pytestmark = pytest.mark.slow  # 2 spawned ranks: ~40 s on a loaded 2-core machine, and a plan's capture


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("traces"))
    return run_scenarios([(traced_collectives, folder)], 2, timeout=240, collective_timeout=60)["traced_collectives"]


def blocked_in_optimizer(trace_file: str) -> float:
    """Seconds gloo's threads ran collectives inside the optimizer ranges, read from the trace file."""
    events = json.loads(pathlib.Path(trace_file).read_text())["traceEvents"]
    ranges = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "picofx.optimizer"]
    work = [(e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name")).startswith("gloo:")]
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in ranges for c, d in work) / 1e6 / len(ranges)


def test_collectives_on_gloos_threads_are_exposed_or_hidden_and_add_up(ranks):
    for steps, collectives, trace in ranks:
        assert [c.kind for c in collectives].count("all_reduce") == 3 * 2  # the traced steps' (not the warm-up's)
        blocked = blocked_in_optimizer(trace)
        assert blocked > 0
        # the blocking all-reduces' time is exposed communication, not the optimizer's
        assert sum(step["exposed_comm"] for step in steps) / len(steps) >= 0.9 * blocked
        for step in steps:
            assert sum(step[k] for k in COMPONENTS) == pytest.approx(step["seconds"], rel=1e-9)
            assert step["hidden_comm"] > 0  # the asynchronous all-reduce beside the matmuls
            # every moment a collective was in flight is either hidden behind compute or exposed
            accounted = step["hidden_comm"] + step["exposed_comm"]
            assert accounted == pytest.approx(step["comm_in_flight"], rel=0.1)


def test_the_traced_collectives_give_the_link_rates_plan_prices_communication_with(ranks, tmp_path, monkeypatch):
    import picofx
    from picofx.cost.comm import all_reduce_seconds
    from picofx.cost.device import cpu
    from picofx.models.llama import CONFIGS
    from picofx.planner.compress import exchange
    from picofx.planner.device_profile import with_link, write_device_profile

    fastest = fastest_of_ranks([collectives for _, collectives, _ in ranks])
    rates = link_rates(fastest, 2)
    measured = rates["all_reduce"]
    assert measured["large"] == 4 and measured["small"] == 2 and measured["bandwidth"] > 0
    big = [c.seconds for c in fastest if c.kind == "all_reduce" and c.nbytes == 4 * GRADIENT_NUMEL]
    device = with_link(dataclasses.replace(cpu(), cpu_share=0.5), {"node": measured}, "a test")  # sharing cores:
    # nothing hides
    fitted = all_reduce_seconds(4 * GRADIENT_NUMEL, 2, device.intra_node_link)
    assert min(big) <= fitted * 1.01 and fitted <= max(big) * 1.01  # the fit lies among what it was fitted to
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path))
    write_device_profile(device, 2, "a test", communication={"dp": rates})
    said = []
    plans = picofx.plan(CONFIGS["tiny"], world=2, seq=32, global_batch=8, gpu="cpu", say=said.append, dp=2, tp=1,
                        pp=1, shard=False, cp=1, compress=None, checkpoint=False, microbatches=1)
    (prediction,) = plans.predictions
    assert any("a test" in line for line in said), said
    expected = exchange(CONFIGS["tiny"], prediction.layout, 4 * 32, device, device.intra_node_link).link_s
    assert prediction.time["data_parallel_exposed"] == pytest.approx(expected, rel=1e-9)
    slower = exchange(CONFIGS["tiny"], prediction.layout, 4 * 32, device, cpu().intra_node_link).link_s
    assert expected != pytest.approx(slower, rel=0.01)  # the nominal link would have priced it otherwise
