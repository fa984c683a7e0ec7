"""`picofx.profile`: a torch.profiler trace of a few steps of one's own loop, and where their time went.

    with picofx.profile(steps=3, directory="profile") as prof:
        for step in range(20):
            with prof.phase("data"):
                batch = next(batches)
            with prof.phase("forward_backward"):
                model.forward_backward(**batch)
            with prof.phase("optimizer"):
                optimizer.step()
            optimizer.zero_grad()
            prof.step()
    print(prof.summary())

A wait/warm-up/active schedule: `wait` steps untouched (compilation, the first batches), `warmup`
steps with the profiler started but discarded, then `steps` traced steps; after them the profiler is
off again. The phase ranges (`phase`, or `wrap` around an object's method) are recorded only inside
the traced window; elsewhere they are a plain call. The trace goes to
`directory/rank<r>.pt.trace.json` (Chrome trace format: Perfetto opens it, and TensorBoard's
profiler plugin reads `*.pt.trace.json` files under its log directory), one file per rank.
"""
from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import re
import warnings

import torch

from picofx.diagnose.breakdown import COMPONENTS, mean_breakdown, spans_of, step_breakdowns
from picofx.diagnose.collectives import collectives_of_trace

PHASES = ("data", "forward_backward", "optimizer", "checkpoint")


def this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


class profile:  # noqa: N801  (used as `with picofx.profile(...)`, as torch.profiler.profile is)
    def __init__(self, steps: int = 3, *, wait: int = 2, warmup: int = 1, directory: str | os.PathLike = "profile",
                 rank: int | None = None, graphs=None, shapes: bool = False):
        if steps < 1 or wait < 0 or warmup < 0:
            raise ValueError(f"picofx.profile: steps {steps}, wait {wait}, warmup {warmup}: steps must be at least 1, "
                             "wait and warmup at least 0")
        self.steps, self.wait, self.warmup = steps, wait, warmup
        self.directory, self.rank, self.graphs = pathlib.Path(directory), rank, graphs
        self.shapes = shapes  # record ops' input shapes: the collectives' sizes, for link rates
        self.collectives: list = []  # each collective the traced steps ran (picofx.diagnose.collectives)
        self.trace: pathlib.Path | None = None  # the trace file, once the traced steps are done
        self.breakdowns: list = []  # StepBreakdown of each traced step
        self.attribution: dict = {}  # per layer and per pass (picofx.runtime.attribution), with `graphs`
        self._prof = None

    @property
    def recording(self) -> bool:
        """Whether the step in progress is traced."""
        if self._prof is None:
            return False
        first = self.wait + self.warmup
        return first <= self._prof.step_num < first + self.steps

    def __enter__(self) -> profile:
        from torch.profiler import ProfilerActivity, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with warnings.catch_warnings():  # no warm-up is a choice here (a run as short as the window)
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            self._prof = torch.profiler.profile(activities=activities, on_trace_ready=self._ready,
                                                record_shapes=self.shapes,
                                                schedule=schedule(wait=self.wait, warmup=self.warmup,
                                                                  active=self.steps, repeat=1))
        self._prof.__enter__()
        return self

    def step(self) -> None:
        """The end of a step (every step, traced or not)."""
        if self._prof is not None and self._prof.step_num < self.wait + self.warmup + self.steps:
            self._prof.step()

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
            self._prof = None

    def phase(self, name: str):
        """A `picofx.<name>` range in the traced steps (PHASES are the breakdown's); elsewhere nothing."""
        return torch.profiler.record_function(f"picofx.{name}") if self.recording else contextlib.nullcontext()

    def wrap(self, owner, method: str, name: str) -> None:
        """`owner.method` runs inside `phase(name)` from now on (an attribute of that one object)."""
        call = getattr(owner, method)

        @functools.wraps(call)
        def in_phase(*args, **kwargs):
            if not self.recording:
                return call(*args, **kwargs)
            with torch.profiler.record_function(f"picofx.{name}"):
                return call(*args, **kwargs)
        setattr(owner, method, in_phase)

    def _ready(self, prof) -> None:
        rank = this_rank() if self.rank is None else self.rank
        self.directory.mkdir(parents=True, exist_ok=True)
        self.trace = self.directory / f"rank{rank}.pt.trace.json"
        prof.export_chrome_trace(str(self.trace))
        self.collectives = collectives_of_trace(self.trace)
        events = prof.events()
        self.breakdowns = step_breakdowns(spans_of(events))
        if self.graphs:
            self.attribution = attribute_by_layer_and_pass(events, self.graphs, steps=max(1, len(self.breakdowns)))

    def mean(self) -> dict:
        """Seconds per traced step of each component (see picofx.diagnose.breakdown)."""
        return mean_breakdown(self.breakdowns)

    def summary(self) -> str:
        """"where the time went" of the traced steps, one line."""
        return where_the_time_went(self.mean())


def attribute_by_layer_and_pass(events, graphs, steps: int = 1) -> dict:
    """Seconds per step (of `steps` traced) per decoder layer and per pass of the ops, from the graph
    node each came from: a node of a fused pattern or a picofx op is fuse's, a functional collective
    the communication passes', any other the model's own."""
    from picofx.capture.vocabulary import traced_module_path
    from picofx.runtime.attribution import attribute

    def layer_of(node) -> str:  # "model.decoder_layers.3" for "model.decoder_layers.3.mlp.up"
        found = re.match(r"(.*?\.\d+)(?:\.|$)", traced_module_path(node) or "")
        return found.group(1) if found else "outside the layers"

    def pass_of(node) -> str:
        target = str(getattr(node.target, "__module__", "")) + str(node.target)
        if (node.meta.get("custom") or {}).get("fused_pattern") or "picofx" in target:
            return "fuse"
        return "collectives" if "c10d" in target else "model"
    graphs = {k: graphs[k] for k in ("forward", "backward") if k in graphs} if isinstance(graphs, dict) else graphs
    by_layer = attribute(events, graphs, label=layer_of)
    by_pass = attribute(events, graphs, label=pass_of)
    return {"by_layer": {k: v / steps for k, v in by_layer.by_label.items()},
            "by_pass": {k: v / steps for k, v in by_pass.by_label.items()},
            "attributed": by_layer.attributed / steps, "unattributed": by_layer.unattributed / steps}


def milliseconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms"


NAMES = {"exposed_comm": "exposed communication", "hidden_comm": "hidden communication"}


def where_the_time_went(mean: dict) -> str:
    if not mean:
        return "no traced step"
    step = mean["seconds"]
    parts = [f"{NAMES.get(k, k)} {100 * mean[k] / step:.0f}%" for k in COMPONENTS if mean[k] >= 0.005 * step
             or k == "unattributed"]
    hidden = f"; {milliseconds(mean['hidden_comm'])} of communication hidden behind compute" \
        if mean.get("comm_in_flight") else ""
    return f"{milliseconds(step)} a step: {', '.join(parts)}{hidden}"


def crash_records(directory: str | os.PathLike, rank: int) -> list[str]:
    """On CUDA: the allocator's history recorded, dumped to `directory/memory_rank<r>.pickle` at an
    out-of-memory error (pytorch.org/memory_viz reads it); NCCL's flight recorder on, dumped to
    `directory/nccl_trace_rank_<r>` when a collective times out (set before the process group is
    made; a value already in the environment is kept). Returns what was armed; nothing on a CPU."""
    if not torch.cuda.is_available():
        return []
    folder = pathlib.Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / "nccl_trace_rank_"))
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    snapshot = folder / f"memory_rank{rank}.pickle"

    def on_out_of_memory(device, alloc, device_alloc, device_free):
        torch.cuda.memory._dump_snapshot(str(snapshot))
    torch._C._cuda_attach_out_of_memory_observer(on_out_of_memory)
    return ["memory snapshot on out-of-memory", "NCCL flight recorder"]
