"""The instrument that says what optimize is doing while it does it: one line per step (capture,
each pass, tracing the backward, partitioning, code generation), each with its time.

    opt = picofx.optimize(model, batch, passes=["fuse"], progress=print)
    # picofx: capturing the training step
    # picofx: captured in 1.4 s (812 nodes)
    # picofx: pass fuse (forward) in 0.9 s: 812 -> 391 nodes
    # ...

`progress` is any function of one string: print, a logger's info, a progress bar's write.
"""
from __future__ import annotations

import time
from typing import Callable

from torch import fx

from picofx.manager.passes import Context, PassRecord

FINISHED = {  # the graph an instrument is shown -> what finished since the previous line
    "captured": "captured",
    "joint": "traced the backward (forward and backward as one joint graph)",
    "partitioned.forward": "partitioned into a forward and a backward graph",
}


class Progress:
    """Instrument: reports each step of capturing and compiling as it finishes, with its time."""

    def __init__(self, say: Callable[[str], object] = print, prefix: str = "picofx: "):
        self.say, self.prefix = say, prefix
        self.started = self.last = time.perf_counter()
        self.cached = False

    def _lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds

    def _line(self, text: str) -> None:
        self.say(f"{self.prefix}{text}")

    def begin(self, cached: bool) -> None:
        self.started = self.last = time.perf_counter()
        self.cached = cached
        self._line("loading the optimized graph from the cache" if cached else "capturing the training step")

    def end(self, backend: str) -> None:
        step = "compiled the backward graph" if backend == "inductor" else "ready to run the graphs (backend eager)"
        self._line(f"{step} in {self._lap():.1f} s; {time.perf_counter() - self.started:.1f} s in all")

    def on_graph(self, label: str, gm: fx.GraphModule, ctx: Context) -> None:
        nodes = len(gm.graph.nodes)
        if label == "captured" and self.cached:
            self._line(f"loaded in {self._lap():.1f} s ({nodes} nodes, the forward passes already run)")
        elif label in FINISHED:
            self._line(f"{FINISHED[label]} in {self._lap():.1f} s ({nodes} nodes)")
        elif label == "partitioned.backward":
            done = "compiled the forward graph" if ctx.backend == "inductor" else "ran the forward graph's passes"
            self._line(f"{done} in {self._lap():.1f} s; backward graph: {nodes} nodes")
        elif label.startswith("stage"):
            self._lap()
            self._line(f"pipeline {label.replace('stage', 'stage ')} ({nodes} nodes): compiling")

    def after_pass(self, record: PassRecord, gm: fx.GraphModule, ctx: Context) -> None:
        where = record.stage.value if record.stage.value == record.graph_role else \
            f"{record.stage.value}, {record.graph_role} graph"
        self._lap()
        self._line(f"pass {record.name} ({where}) in {record.seconds:.1f} s: "
                   f"{record.nodes_before} -> {record.nodes_after} nodes")


def tell(instruments, event: str, *, cached: bool = False, backend: str = "") -> None:
    """Start (`event` "begin": capturing, or loading from the cache when `cached`) or finish
    (`event` "end", compiled with `backend`) the lines of every Progress among `instruments`;
    other instruments see graphs only."""
    for instrument in instruments:
        if isinstance(instrument, Progress):
            instrument.begin(cached) if event == "begin" else instrument.end(backend)
