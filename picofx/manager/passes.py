"""What a pass is: its declaration, its context, its result, its record; the registry of pass names.

A pass is `(gm, ctx) -> PassResult`: a plain function registered with `register_pass`, or a
frozen dataclass with `__call__` when it has options. It declares what it is once, in a
`PassInfo`: its stage, the passes it must run before or after, the mesh dimensions it works over,
whether it communicates, splits the graph or measures. A class holds it as `info` (a class
attribute, or a property when it depends on the options); a function gets it from
`register_pass(name, Stage.JOINT)` or `register_pass(name, PassInfo(...))`, or as its own `info`
attribute. A pass that declares nothing is a forward pass. Everything reads a declaration through
`pass_info(p)`. Names resolve through `PASSES`, which the passes fill when they are imported
(`import picofx` imports picofx's own); the core never imports a pass.
"""
from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import fx, nn

from picofx.parallel.mesh import check_name


class Stage(enum.Enum):
    FORWARD = "forward"          # the captured forward graph, loss included
    JOINT = "joint"              # forward + backward in one graph (primals, tangents)
    PARTITIONED = "partitioned"  # the forward and backward graphs after partitioning


class GraphRole(enum.StrEnum):
    """Which graph a pass is given (`ctx.graph_role`)."""

    FORWARD = "forward"    # the captured forward graph, or the forward graph after partitioning
    JOINT = "joint"
    BACKWARD = "backward"


class SyncMode(enum.StrEnum):
    """How the step's backward synchronises data-parallel gradients (`ctx.gradient_sync`)."""

    SYNC = "sync"
    LOCAL = "local"                           # inside no_sync(): each rank keeps its own gradients
    SYNC_ACCUMULATED = "sync_accumulated"     # the first synced step after no_sync: adds what accumulated
    SYNC_UNCOMPRESSED = "sync_uncompressed"   # a compressor's warm-up steps: whole gradients


@dataclass
class PassResult:
    changed: bool = False
    notes: dict[str, Any] = field(default_factory=dict)
    tolerance: tuple[float, float] | None = None  # (rtol, atol) when the pass changes rounding on purpose
    normwise: bool = False                          # compare per tensor as ||a-b|| <= rtol*||b|| + atol
    graphs: list[fx.GraphModule] | None = None      # set when the pass splits the graph into several


@dataclass(frozen=True)
class PassInfo:
    """What a pass declares about itself. The manager checks it before anything is captured and
    orders the passes by it; the runtime reads it (never the pass's other attributes).

    runs_before / runs_after name other passes (by registered name) that, when they are given too,
    must run after / before this one: the manager sorts the passes it is given to honour them and
    otherwise keeps the caller's order. requires names passes that must run before this one even
    when not given: the manager adds each one missing (with its defaults), so no pass runs another
    inside itself."""

    stage: Stage = Stage.FORWARD
    also_at: tuple[Stage, ...] = ()  # later stages it runs at too (it reads ctx.stage to know which)
    runs_before: tuple[str, ...] = ()
    runs_after: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()   # run before it, added with their defaults when not given
    mesh_dims: tuple[str, ...] = ()  # the parallel mesh's dimensions it works over ("dp_replicate", "pp", ...)
    mesh_size: int | None = None     # the size it needs on the first of them, if any (a pipeline's stages)
    communicates: bool = False       # it inserts collectives: compiled keeping them overlapped; layouts checked
    splits_graph: bool = False       # it returns one graph per pipeline stage (PassResult.graphs)
    microbatches: bool = False       # the step runs in micro-batches: it captures one (`capture_inputs`)
    measures: bool = False           # it runs real steps to decide (its result is never cached)
    replans: bool = False            # after a real step is measured it may re-plan (`after_measured_step`)
    plans_partition: bool = False    # it decides what the backward saves: picofx's partitioner runs
    tags_only: bool = False          # it only writes node.meta tags: no graph copy before it, no re-annotation

    def __post_init__(self):
        if not isinstance(self.stage, Stage) or not all(isinstance(s, Stage) for s in self.also_at):
            raise TypeError(f"PassInfo: stage and also_at are picofx.Stage values, got {self.stage!r}, "
                            f"{self.also_at!r}")
        for field_name in ("runs_before", "runs_after", "requires", "also_at", "mesh_dims"):
            if not isinstance(getattr(self, field_name), tuple):
                raise TypeError(f"PassInfo({field_name}=...): a tuple, e.g. {field_name}=('shard',), "
                                f"got {getattr(self, field_name)!r}")

    @property
    def stages(self) -> tuple[Stage, ...]:
        return (self.stage, *self.also_at)


@dataclass
class Context:
    """Everything a pass may read. Passes read no globals and no environment variables."""

    model: nn.Module
    example_inputs: list           # real values of the current graph's placeholders, in order
    device: torch.device
    backend: str = "eager"
    options: dict[str, Any] = field(default_factory=dict)  # the user's `optimize(options=...)`
    cost_model: Any = None
    stage: Stage = Stage.FORWARD
    graph_role: GraphRole = GraphRole.FORWARD
    mesh: Any = None               # picofx.parallel.ParallelMesh of the run (None: one process)
    input_names: list | None = None  # the graph's inputs' parameter names (None for other inputs)
    gradient_sync: SyncMode = SyncMode.SYNC
    cache_directory: str | None = None  # the on-disk cache's directory, when it is on

    def __post_init__(self):  # "backward" given for a role is GraphRole.BACKWARD: passes compare with `is`
        self.graph_role, self.gradient_sync = GraphRole(self.graph_role), SyncMode(self.gradient_sync)


@dataclass
class PassRecord:
    name: str
    stage: Stage
    graph_role: GraphRole
    seconds: float
    nodes_before: int
    nodes_after: int
    added: list[str]
    removed: list[str]
    changed: bool
    notes: dict[str, Any]


class Instrument(Protocol):
    def on_graph(self, label: str, gm: fx.GraphModule, ctx: Context) -> None: ...
    def after_pass(self, record: PassRecord, gm: fx.GraphModule, ctx: Context) -> None: ...


PASSES: dict[str, Callable[[], Callable]] = {}


@dataclass(frozen=True)
class RegisteredPass:
    """A function registered as a pass: its own name and declaration, so one function registered
    under two names (and stages) gives two passes. Calls the function."""

    function: Callable
    pass_name: str
    info: PassInfo

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        return self.function(gm, ctx)


def register_pass(name: str, declared: Stage | PassInfo | None = None):
    """Register a pass under `name`: a function `(gm, ctx) -> PassResult`, or a dataclass type
    whose no-argument instance is the pass with default options. A class declares itself (its
    `info`); a function is declared here by `declared`, a Stage or a whole PassInfo (default: the
    function's own `info`, else a forward pass). A function comes back as a RegisteredPass with
    this name and declaration; registering it again gives another pass."""

    def register(obj):
        if name in PASSES:
            raise ValueError(f"register_pass: a pass named {name!r} is already registered")
        if isinstance(obj, type):
            if declared is not None:
                raise ValueError(f"register_pass({name!r}, {declared}): {obj.__name__} is a class, which declares "
                                 "itself: give it `info = PassInfo(...)` and register it with register_pass(name)")
            obj = _named_class(obj, name)
            PASSES[name] = obj
            return obj
        function = obj.function if isinstance(obj, RegisteredPass) else obj
        if declared is None:
            info = pass_info(obj)
        else:
            info = declared if isinstance(declared, PassInfo) else PassInfo(declared)
        registered = RegisteredPass(function, name, info)
        PASSES[name] = lambda: registered
        return registered

    return register


def _named_class(cls: type, name: str) -> type:
    """`cls` named `name`. A class registered before, under another name, is subclassed, so each
    registration keeps its name."""
    if "pass_name" in cls.__dict__:
        return type(cls.__name__, (cls,), {"pass_name": name, "__module__": cls.__module__, "__doc__": cls.__doc__})
    cls.pass_name = name
    return cls


def resolve_pass(spec) -> Callable:
    """The pass `spec` names: a registered name or a pass object. Mistakes are reported here,
    before anything is captured."""
    if isinstance(spec, str):
        if spec not in PASSES:
            close = difflib.get_close_matches(spec, PASSES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise KeyError(f"unknown pass {spec!r}; available passes: {', '.join(sorted(PASSES))}{hint}")
        return PASSES[spec]()
    if isinstance(spec, type):
        raise TypeError(f"passes takes pass objects, got the class {spec.__name__}: "
                        f"did you mean {spec.__name__}()?")
    if not callable(spec):
        raise TypeError(f"a pass is a registered name or a callable (gm, ctx) -> PassResult, got {spec!r}")
    return spec


def resolve_passes(passes) -> list:
    """`passes` (a list of names and pass objects) resolved, each checked."""
    if isinstance(passes, str):
        raise TypeError(f"passes is a list: passes=[{passes!r}], not passes={passes!r}")
    if callable(passes) and not isinstance(passes, type):
        raise TypeError(f"passes is a list: passes=[{pass_name(passes)}], not a single pass")
    resolved = [resolve_pass(p) for p in passes]
    check_declarations(resolved)
    return resolved


def pass_name(p) -> str:
    if isinstance(p, str):  # a registered name
        return p
    return getattr(p, "pass_name", None) or getattr(p, "__name__", None) or type(p).__name__.lower()


def pass_info(p) -> PassInfo:
    """What pass `p` declares: its `info`; a pass that declares nothing is a forward pass."""
    info = getattr(p, "info", None)
    return info if isinstance(info, PassInfo) else PassInfo()


def pass_stage(p) -> Stage:
    return pass_info(p).stage


def runs_at(p, stage: Stage) -> bool:
    return stage in pass_info(p).stages


def check_declarations(passes: list) -> None:
    """Each pass's declaration is one picofx can honour, and the passes fit together; raised
    before anything is captured."""
    splitting = [pass_name(p) for p in passes if pass_info(p).splits_graph]
    if len(splitting) > 1:
        raise ValueError(f"passes {splitting} each split the step into pipeline stages; use one of them.")
    for p in passes:
        info, name = pass_info(p), pass_name(p)
        stage = getattr(p, "stage", None)
        if isinstance(stage, Stage):  # a declaration of old, which the manager would no longer read
            raise ValueError(f"pass {name!r} declares `stage = {stage}`; a pass declares itself once, in its "
                             f"PassInfo: info = PassInfo({stage}) (a function: register_pass({name!r}, {stage})).")
        if info.splits_graph and (info.stage is not Stage.FORWARD or info.also_at):
            raise ValueError(f"pass {name!r} splits the graph at the {info.stage.value} stage; only forward "
                             "passes may split it (stage graphs are compiled one by one).")
        if info.microbatches and not callable(getattr(p, "capture_inputs", None)):
            raise ValueError(f"pass {name!r} declares micro-batches but has no capture_inputs(args, kwargs).")
        if info.replans and not callable(getattr(p, "after_measured_step", None)):
            raise ValueError(f"pass {name!r} declares it re-plans but has no after_measured_step(record, peak).")
        for dim in info.mesh_dims:
            check_name(dim)
        unknown = [r for r in info.requires if r not in PASSES]
        if unknown:
            raise ValueError(f"pass {name!r} declares requires={unknown}, but no pass is registered under that name; "
                             f"registered: {', '.join(sorted(PASSES))}")
