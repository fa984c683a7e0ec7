"""The tests' rank harness is picofx's own (picofx.parallel.launch): gloo ranks in spawned processes,
a hard timeout, every process it started killed at the end."""
import contextlib

from picofx.parallel.launch import RankError, free_port, run_ranks  # noqa: F401


@contextlib.contextmanager
def fake_ranks(world: int):
    """A `world`-rank process group in this process whose collectives move nothing (rank 0 of it):
    enough to build a distributed run's graphs without spawning ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def scenarios(rank: int, world: int, calls) -> dict:
    """Each `(fn, *args)` of `calls` in turn on these ranks, `fn(rank, world, *args)`'s result by
    fn's name. Before each, the state a fresh rank would start from: torch's seed, Dynamo's caches."""
    import torch

    seed = torch.initial_seed()
    out = {}
    for fn, *args in calls:
        torch._dynamo.reset()
        torch.manual_seed(seed)
        try:
            out[fn.__name__] = fn(rank, world, *args)
        except BaseException as e:  # noqa: BLE001  (the group's error names the scenario)
            raise RuntimeError(f"scenario {fn.__name__}: {type(e).__name__}: {e}") from e
    return out


def run_scenarios(calls, world: int, *, timeout: float, collective_timeout: float) -> dict[str, list]:
    """One spawned group of `world` ranks running every scenario of `calls` (see `scenarios`), instead
    of a group each: the ranks start, import and trace fuse's patterns once. Returns each scenario's
    results per rank, by its function's name."""
    ranks = run_ranks(scenarios, world, calls, timeout=timeout, collective_timeout=collective_timeout)
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}
