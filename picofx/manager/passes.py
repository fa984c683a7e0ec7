"""What a pass is: its stage, its context, its result, its record; the registry of pass names.

A pass is `(gm, ctx) -> PassResult`: a plain function registered with `register_pass`, or a
frozen dataclass with `__call__` when it has options. It declares its stage with a `stage`
attribute (a function may instead be given one by `register_pass`). Names resolve through
`PASSES`, which the passes fill when they are imported (`import picofx` imports picofx's own);
the core never imports a pass.
"""
from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import fx, nn


class Stage(enum.Enum):
    FORWARD = "forward"          # the captured forward graph, loss included
    JOINT = "joint"              # forward + backward in one graph (primals, tangents)
    PARTITIONED = "partitioned"  # the forward and backward graphs after partitioning


@dataclass
class PassResult:
    changed: bool = False
    notes: dict[str, Any] = field(default_factory=dict)
    tolerance: tuple[float, float] | None = None  # (rtol, atol) when the pass changes rounding on purpose
    normwise: bool = False                          # compare per tensor as ||a-b|| <= rtol*||b|| + atol
    graphs: list[fx.GraphModule] | None = None      # set when the pass splits the graph into several


@dataclass
class Context:
    """Everything a pass may read. Passes read no globals and no environment variables."""

    model: nn.Module
    example_inputs: list           # real values of the current graph's placeholders, in order
    device: torch.device
    backend: str = "eager"
    options: dict[str, Any] = field(default_factory=dict)
    cost_model: Any = None
    stage: Stage = Stage.FORWARD
    graph_role: str = "forward"    # "forward", "joint" or "backward"


@dataclass
class PassRecord:
    name: str
    stage: Stage
    graph_role: str
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
    """A function registered as a pass: its own name and stage, so one function registered under
    two names (and stages) gives two passes. Calls the function."""

    function: Callable
    pass_name: str
    stage: Stage

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        return self.function(gm, ctx)


def register_pass(name: str, stage: Stage | None = None):
    """Register a pass under `name`: a function `(gm, ctx) -> PassResult` or a dataclass type
    whose no-argument instance is the pass with default options. `stage` defaults to the one the
    pass declares (a `stage` attribute), else Stage.FORWARD. A function comes back as a
    RegisteredPass with this name and stage; registering it again gives another pass."""

    def register(obj):
        if name in PASSES:
            raise ValueError(f"register_pass: a pass named {name!r} is already registered")
        if isinstance(obj, type):
            obj = _registered_class(obj, name, stage)
            PASSES[name] = obj
            return obj
        function = obj.function if isinstance(obj, RegisteredPass) else obj
        registered = RegisteredPass(function, name, stage or getattr(function, "stage", Stage.FORWARD))
        PASSES[name] = lambda: registered
        return registered

    return register


def _registered_class(cls: type, name: str, stage: Stage | None) -> type:
    """`cls` named `name`, at the stage it declares (or `stage` when it declares none). A class
    registered before, under another name, is subclassed, so each registration keeps its name."""
    declared = getattr(cls, "stage", None)
    if stage is not None and declared is not None and stage is not declared:
        raise ValueError(f"register_pass({name!r}, {stage}): {cls.__name__} declares stage {declared}; "
                         "drop the stage argument or the class's `stage` attribute")
    if "pass_name" in cls.__dict__:
        return type(cls.__name__, (cls,), {"pass_name": name, "stage": declared or stage or Stage.FORWARD,
                                           "__module__": cls.__module__, "__doc__": cls.__doc__})
    cls.pass_name = name
    cls.stage = declared or stage or Stage.FORWARD
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
    return [resolve_pass(p) for p in passes]


def pass_name(p) -> str:
    return getattr(p, "pass_name", None) or getattr(p, "__name__", None) or type(p).__name__.lower()


def pass_stage(p) -> Stage:
    return getattr(p, "stage", Stage.FORWARD)
