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

A rank that dies (killed, its machine gone) breaks its connections at once: the others' collectives
fail with the backend's own error (gloo's "connection reset by peer" or "closed by peer": PEER_GONE)
well before the timeout. A rank whose collective failed asks the watchdog (`stop_if_a_peer_died`)
whose heartbeat stopped, and if one did, stops with one line naming it instead of the backend's
traceback.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time

from tqdm import tqdm

PREFIX = "picofx/watchdog"
DONE = "done"
FAILED = "failed:"  # the place of a rank that stopped because a collective failed (not itself a dead rank)
STOPPED_BEATS = 2   # a peer whose count has not moved for this many beats has stopped beating
# What a backend's error says when the rank at the other end of a connection died (gloo's words
# differ from one death to the next: either of the first two).
PEER_GONE = ("Connection reset", "Connection closed", "Broken pipe")


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
        self.failed = False  # this rank's collective failed: its place is published as FAILED's
        self.seen: dict[int, tuple[int, float]] = {}  # peer -> (its count, when this rank saw it change)
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self.run, name="picofx-watchdog", daemon=True)

    def key(self, kind: str, rank: int) -> str:
        return f"{PREFIX}/{kind}/{rank}"

    def start(self) -> Watchdog:
        self.store.set(self.key("at", self.rank), self.published())
        self.store.add(self.key("beat", self.rank), 1)
        now = time.monotonic()
        self.seen = {peer: (-1, now) for peer in range(self.world) if peer != self.rank}
        self.thread.start()
        return self

    def at(self, step: int, phase: str) -> None:
        """What the main thread does now: `phase` of step `step` (counted from 1)."""
        self.place = f"step {step}'s {phase}"

    def published(self) -> str:
        return f"{FAILED} {self.place}" if self.failed else self.place

    def stop(self) -> None:
        """This rank's run ended: no more beats, and the others stop waiting for them."""
        if self.finished.is_set():
            return
        self.finished.set()
        self.thread.join(timeout=2 * self.interval + 5)
        self.store.set(self.key("at", self.rank), DONE)

    def run(self) -> None:
        while not self.finished.wait(self.interval):
            self.store.set(self.key("at", self.rank), self.published())
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
            elif now - since > self.timeout and not self.ended(peer):
                silent.append(peer)
        return silent

    def ended(self, peer: int) -> bool:
        """Whether `peer` said it ended its run, or stopped after a collective failed."""
        place = self.last_seen(peer)
        return place == DONE or place.startswith(FAILED)

    def stop_if_a_peer_died(self, error: BaseException, before_stop=lambda: None) -> None:
        """After a collective raised `error` on this rank: when it is a collective's failure and a peer's
        heartbeat has stopped (watched for up to STOPPED_BEATS beats), `before_stop()`, then
        `on_hang` with one line naming the peer, where it was and this rank's collective. Else
        returns, for the caller to raise `error` as it is."""
        cause = collective_error(error)
        if cause is None or self.finished.is_set():
            return
        self.failed = True  # the peers' checks pass over this rank, which ends too
        self.store.set(self.key("at", self.rank), self.published())
        dead = self.stopped_peers()
        if not dead:
            return
        self.finished.set()
        before_stop()
        self.on_hang(self.died_line(dead, cause), speaks=self.speaks(dead))

    def stopped_peers(self) -> list[int]:
        """The peers whose beat count stays still for STOPPED_BEATS beats (at most that long a wait:
        a live peer's moves within one), those that ended their run or stopped themselves excluded."""
        limit, start = STOPPED_BEATS * self.interval, time.monotonic()
        count = {peer: self.store.add(self.key("beat", peer), 0) for peer in self.seen}
        undecided = set(count)
        while undecided and time.monotonic() - start <= limit:
            time.sleep(min(0.05, self.interval / 4))
            undecided -= {peer for peer in undecided if self.store.add(self.key("beat", peer), 0) != count[peer]}
        return sorted(peer for peer in undecided if not self.ended(peer))

    def died_line(self, dead: list[int], error: BaseException) -> str:
        first, others = dead[0], "".join(f" and {peer}" for peer in dead[1:])
        cause = backend_message(error)
        return (f"picofx train: error: rank{'s' if others else ''} {first}{others} died: no heartbeat for "
                f"{STOPPED_BEATS * self.interval:g} s (killed, or its machine gone), last heard from in "
                f"{self.last_seen(first)}; rank {self.rank}'s collective in {self.place} failed with it ({cause}). "
                f"Every rank stops: look at why rank {first} ended (its own output, the machine's log of killed "
                "processes)")

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


def backend_message(error: BaseException) -> str:
    """The first sentence of an error, without the source location gloo puts before it."""
    text = " ".join(str(error).split())
    text = re.sub(r"^\[[^\]]*:\d+\] ", "", text)
    return re.split(r"(?<=\.) ", text, maxsplit=1)[0][:200]


def collective_error(error: BaseException | None) -> BaseException | None:
    """`error`, or the error that caused it, where it is a collective's or the store's (torch's
    DistError kinds, and the backends' errors that torch raises as plain RuntimeErrors); else None."""
    import torch.distributed as dist

    while error is not None:
        text = str(error)
        if isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and any(
                mark in text for mark in (*PEER_GONE, "gloo", "NCCL"))):
            return error
        error = error.__cause__ or error.__context__
    return None
