"""A watchdog that stops a distributed run when a rank stops answering, naming who and where.

Each rank runs a thread that beats (a counter in the store torchrun's rendezvous made, which every
rank reaches) and publishes what its main thread is doing: the step and the phase, named by the
collectives it runs ("step 12's forward and backward (gradient all-reduces)"). The thread also
watches the other ranks' counters: one that has not moved for `timeout` seconds belongs to a rank
that stopped answering (stopped, frozen, its machine gone), and every collective with it would wait
forever. Then every other rank stops: the lowest of them prints one line naming the rank, where it
was last seen and where this rank was, and each exits with status 1 (torchrun then ends the job).

Where a rank was is as of its last beat (a tenth of the timeout, at most 5 s, before it stopped).
A rank busy for longer than `timeout` (compiling, writing a checkpoint) keeps beating: only a rank
that does not answer at all is stopped for. A rank that ends its run says so, and is not waited for.
The process group's own timeout should be longer than `timeout`, so that this line comes first.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from tqdm import tqdm

PREFIX = "picofx/watchdog"
DONE = "done"


def stop_process(line: str, speaks: bool) -> None:
    """The default on a hang: the line on stderr (one rank says it), then exit status 1 at once: the
    main thread is stuck in a collective and cannot unwind."""
    if speaks:  # below a progress bar, not on its line
        tqdm.write(line, file=sys.stderr)
        sys.stderr.flush()
    os._exit(1)


def beat_interval(timeout: float) -> float:
    """Beats often enough that a stopped rank is seen within a tenth of the timeout of it."""
    return min(5.0, max(0.1, timeout / 10))


class Watchdog:
    """`store`: a torch.distributed Store every rank reaches (picofx.parallel.launch.rendezvous_store);
    `on_hang(line, speaks)`: what to do when a rank stopped answering (default: stop_process)."""

    def __init__(self, store, rank: int, world: int, timeout: float, *, on_hang=stop_process,
                 what: str = "--collective-timeout"):
        self.store, self.rank, self.world, self.timeout = store, rank, world, timeout
        self.on_hang, self.what = on_hang, what
        self.interval = beat_interval(timeout)
        self.place = "setup"
        self.seen: dict[int, tuple[int, float]] = {}  # peer -> (its count, when this rank saw it change)
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self.run, name="picofx-watchdog", daemon=True)

    def key(self, kind: str, rank: int) -> str:
        return f"{PREFIX}/{kind}/{rank}"

    def start(self) -> Watchdog:
        self.store.set(self.key("at", self.rank), self.place)
        self.store.add(self.key("beat", self.rank), 1)
        now = time.monotonic()
        self.seen = {peer: (-1, now) for peer in range(self.world) if peer != self.rank}
        self.thread.start()
        return self

    def at(self, step: int, phase: str) -> None:
        """What the main thread does now: `phase` of step `step` (counted from 1)."""
        self.place = f"step {step}'s {phase}"

    def stop(self) -> None:
        """This rank's run ended: no more beats, and the others stop waiting for them."""
        if self.finished.is_set():
            return
        self.finished.set()
        self.thread.join(timeout=2 * self.interval + 5)
        self.store.set(self.key("at", self.rank), DONE)

    def run(self) -> None:
        while not self.finished.wait(self.interval):
            self.store.set(self.key("at", self.rank), self.place)
            self.store.add(self.key("beat", self.rank), 1)
            silent = self.silent_peers()
            if silent:
                self.finished.set()
                self.on_hang(self.line(silent), speaks=self.speaks(silent))
                return

    def silent_peers(self) -> list[int]:
        """The ranks whose beat has not moved for `timeout` seconds and that did not end their run."""
        now, silent = time.monotonic(), []
        for peer, (count, since) in self.seen.items():
            current = self.store.add(self.key("beat", peer), 0)  # reads without waiting for the key
            if current != count:
                self.seen[peer] = (current, now)
            elif now - since > self.timeout and self.last_seen(peer) != DONE:
                silent.append(peer)
        return silent

    def last_seen(self, peer: int) -> str:
        if self.seen[peer][0] <= 0:  # it never beat: its place was never written
            return "setup (it never beat)"
        return self.store.get(self.key("at", peer)).decode()

    def speaks(self, silent: list[int]) -> bool:
        """The lowest rank still answering says it, so the run's stderr holds one line."""
        return self.rank == min(r for r in range(self.world) if r not in silent)

    def line(self, silent: list[int]) -> str:
        first = silent[0]
        others = f" (and rank{'s' if len(silent) > 2 else ''} {', '.join(map(str, silent[1:]))})" \
            if len(silent) > 1 else ""
        return (f"picofx train: error: rank {first}{others} stopped answering: no heartbeat for "
                f"{self.timeout:g} s, last heard from in {self.last_seen(first)}; rank {self.rank} was waiting "
                f"in {self.place}. Every rank stops ({self.what} {self.timeout:g}): look at what stopped rank "
                f"{first} (a stopped or frozen process, its machine gone, a debugger's breakpoint)")
