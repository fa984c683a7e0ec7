"""Run a function on several gloo ranks in spawned processes of this machine, with a hard timeout
(the planner's measurements, the tests, the benchmarks); join the group torchrun launched; do a
thing once per machine while its other ranks wait.

`run_ranks(fn, world, timeout=...)` starts `world` processes that each init a gloo group (with
a collective timeout shorter than the call's), call `fn(rank, world, *args)` and send back its
result or its error. A rank that hangs or dies raises RankError here; every process this call
started is killed at the end, and only those.
"""
from __future__ import annotations

import datetime
import faulthandler
import hashlib
import io
import os
import pickle
import queue
import signal
import sys
import socket
import time
import traceback

import torch.multiprocessing as mp


class RankError(AssertionError):
    pass


def join_launched_group(device: str, timeout: datetime.timedelta, agreement_timeout: datetime.timedelta):
    """This process's rank in the group torchrun launched (made here unless a caller made it), and
    a second gloo group of its own timeout on which ranks agree whether their setup succeeded.
    Returns (rank, agreement group, whether this call made the default group)."""
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=timeout,
                                **attempt_store(timeout))
    return dist.get_rank(), dist.new_group(backend="gloo", timeout=agreement_timeout), made


def attempt_store(timeout: datetime.timedelta) -> dict:
    """Under torchrun's agent store, the keys of this attempt of the job alone: workers that torchrun
    restarts (--max-restarts) would otherwise read the first attempt's gloo addresses, and fail to
    connect to ranks that are gone."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"picofx/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def rendezvous_store():
    """The key-value store of the default process group's rendezvous (under torchrun, its agent's),
    which every rank reaches whatever its collectives are doing: the watchdog's heartbeats."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


ONCE_POLL_SECONDS = 0.05
_once_calls: dict[str, int] = {}  # calls of once_per_machine by name in this process: every rank makes the same


def once_per_machine(make, name: str):
    """`make()` on one rank of each machine (the first there to ask) while the machine's other ranks
    wait for its result (which must pickle: a file's description, say), and return it too. Without
    a process group, make() alone. The first rank's error is raised on the others as well, so none
    waits for ever (a first rank that dies is the watchdog's: it stops beating)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    store = rendezvous_store()
    _once_calls[name] = _once_calls.get(name, 0) + 1
    digest = hashlib.sha256(f"{socket.gethostname()} {name}".encode()).hexdigest()[:16]
    key = f"picofx/once/{digest}/{_once_calls[name]}"
    if store.add(f"{key}/first", 1) == 1:
        try:
            result = make()
        except BaseException as e:
            store.set(f"{key}/done", pickled("error", e))
            raise
        store.set(f"{key}/done", pickled("ok", result))
        return result
    while not store.check([f"{key}/done"]):
        time.sleep(ONCE_POLL_SECONDS)
    status, value = pickle.loads(store.get(f"{key}/done"))
    if status == "error":
        raise value
    return value


def pickled(status: str, value) -> bytes:
    try:
        return pickle.dumps((status, value))
    except Exception:  # noqa: BLE001  (an error that does not pickle goes as its text)
        if status == "ok":
            raise
        return pickle.dumps((status, RuntimeError(f"{type(value).__name__}: {value}")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world: int, port: int, collective_timeout: float, args, results):
    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a native crash prints this rank's Python stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # started from a torchrun rank: its own store, not torchrun's
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        value = fn(rank, world, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # plain bytes: tensors sent by reference would die with this process
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as e:  # noqa: BLE001  (reported to the caller, which raises it)
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        results.close()
        results.join_thread()  # the message is out before the process ends
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)  # a rank can hang at interpreter exit otherwise


def _run_group(fn, world: int, args, timeout: float, collective_timeout: float) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, collective_timeout, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple] = {}
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(out) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise RankError(f"ranks {sorted(set(range(world)) - set(out))} did not finish in {timeout}s")
            try:
                rank, status, value = results.get(timeout=min(left, 5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                if dead:
                    try:  # its last message may still be in flight
                        rank, status, value = results.get(timeout=5)
                    except queue.Empty:
                        signals = {r: procs[r].exitcode for r in dead if (procs[r].exitcode or 0) < 0}
                        if signals:
                            raise RankCrashed(", ".join(f"rank {r} died of {signal.Signals(-code).name}"
                                                        for r, code in signals.items())) from None
                        raise RankError(f"ranks {dead} exited without a result") from None
                else:
                    continue
            out[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return out


# Set by the test suite: a spawned group one of whose ranks died of a signal (a native crash inside
# torch's C++, seen about once per suite run) runs once more, after its stack and a line on stderr.
CRASH_RETRIES_ENV = "PICOFX_RANK_CRASH_RETRIES"


class RankCrashed(RankError):
    """A rank died of a signal, not of a Python exception."""


def run_ranks(fn, world: int = 2, *args, timeout: float = 240, collective_timeout: float = 60,
              expect_errors: bool = False) -> list:
    """Results of `fn(rank, world, *args)` per rank (fn must be importable: a module-level function).
    With expect_errors, each rank's error text (or None) is returned instead of raising."""
    retries = int(os.environ.get(CRASH_RETRIES_ENV, "0"))
    for attempt in range(retries + 1):
        try:
            out = _run_group(fn, world, args, timeout, collective_timeout)
            break
        except RankCrashed as e:
            if attempt == retries:
                raise
            print(f"picofx.parallel.launch: {e}; running {getattr(fn, '__name__', fn)} on {world} ranks once more",
                  file=sys.stderr, flush=True)
    if expect_errors:
        return [out[r][1] if out[r][0] == "error" else None for r in range(world)]
    errors = [f"rank {r}: {value}" for r, (status, value) in sorted(out.items()) if status == "error"]
    if errors:
        raise RankError("\n".join(errors))
    import torch

    return [torch.load(io.BytesIO(out[r][1]), weights_only=False) for r in range(world)]
