"""The on-disk cache of optimized graphs: a second identical run skips capture and the passes.

An entry holds the forward graph as the forward-stage passes left it (nodes, targets, arguments,
the node annotations that are not recomputed: module paths, module stacks), the tensors it holds,
the capture's signature, the pass records for the report, and what joint-stage passes decided
(`JointDecisions`: the node annotations they set, e.g. checkpoint's recompute tags, replayed on the
joint graph that AOT traces again from the cached forward graph; AOT and code generation run again,
and Inductor's own cache serves the latter).

The key covers everything the graph depends on that picofx can see: the model's module tree
(classes, their simple attributes and config), parameter and buffer names, shapes, dtypes and
devices, the source files of the model's classes and of the loss function, the call's input
shapes and values, the passes and their options, the registered rewrite rules (their functions'
source), the backend and the options, the device the model is on (a GPU by its name and compute
capability: fuse may have timed its kernels there) and the versions of picofx (its source files),
torch, triton and Python. Not cached, and the report says why: passes that communicate, split the graph, measure a
real step or run on the partitioned graphs; models or inputs on fake tensors or the meta device;
a given cost model; numerics verification; instruments that need every pass to run (dumps).
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import os
import pickle
import sys
import warnings
from pathlib import Path

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from picofx.capture.annotate import annotate
from picofx.capture.graph_data import add_nodes, node_records
from picofx.manager import Stage
from picofx.manager.passes import pass_info, pass_name, runs_at
from picofx.manager.progress import Progress
from picofx.rewrite import registered_rules
from picofx.runtime.kernel_choice import environment
from picofx.capture.vocabulary import SIGNATURE_META

FORMAT = 3  # bump when an entry's layout changes: older entries are then ignored and rewritten
VOLATILE_META = ("val", "flops", "bytes", "tensor_meta", "example_value", "unbacked_bindings")


class NotCacheable(Exception):
    """Something the key would have to cover that it cannot describe."""


# ---- the key ---------------------------------------------------------------------------------

def describe(value, depth: int = 0):
    """A stable, picklable description of an option's value; NotCacheable when there is none."""
    if depth > 20:
        raise NotCacheable("an option nests too deep to describe")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (list, tuple)):
        return [describe(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return sorted((str(k), describe(v, depth + 1)) for k, v in value.items())
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__} {source_digest(value)}"
    if dataclasses.is_dataclass(value):
        return [type(value).__qualname__, source_digest(type(value))] + [
            (f.name, describe(getattr(value, f.name), depth + 1)) for f in dataclasses.fields(value) if f.compare]
    if inspect.isfunction(value):
        cells = [describe(c.cell_contents, depth + 1) for c in value.__closure__ or ()]
        return [f"{value.__module__}.{value.__qualname__}", source_digest(value), cells]
    if isinstance(value, torch._ops.OpOverload):
        return str(value)
    raise NotCacheable(f"{type(value).__name__} values cannot be keyed")


def source_digest(obj) -> str:
    try:
        return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
    except (OSError, TypeError) as e:
        raise NotCacheable(f"the source of {getattr(obj, '__qualname__', obj)!r} is not available") from e


def file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _picofx_sources(passes) -> list:
    """Every source file of picofx and of the packages its passes live in."""
    import picofx.manager as manager

    roots = {Path(manager.__file__).parent.parent}
    roots |= {Path(sys.modules[type(p).__module__].__file__).parent for p in passes
              if getattr(sys.modules.get(type(p).__module__), "__file__", None)}
    return sorted((str(p), file_digest(p)) for root in roots for p in root.rglob("*.py"))


def model_description(model: nn.Module) -> list:
    """Module tree, simple attributes, config, parameters and buffers, and the classes' source files."""
    modules, files = [], set()
    for name, module in model.named_modules():
        attributes = sorted((k, describe(v)) for k, v in vars(module).items() if not k.startswith("_")
                            and isinstance(v, (bool, int, float, str, type(None), tuple)))
        modules.append((name, f"{type(module).__module__}.{type(module).__qualname__}", attributes))
        for cls in type(module).__mro__:
            if cls.__module__.split(".")[0] not in ("torch", "builtins"):
                files.add(inspect.getsourcefile(cls) or "")
    config = getattr(model, "config", None)
    if config is not None:
        modules.append(("config", config.to_json_string() if hasattr(config, "to_json_string") else describe(config)))
    tensors = [(kind, name, tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad)
               for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers()))
               for name, t in named]
    return [modules, tensors, sorted((f, file_digest(f)) for f in files if f)]


def cache_key(model: nn.Module, inputs_key: tuple, *, passes, loss_fn, backend: str, verify, instruments,
              options: dict, cost_model) -> str:
    """The entry's name: a digest of everything the optimized graph depends on. NotCacheable with
    the reason when the graph cannot be cached."""
    why_not = _not_cacheable(model, passes, verify, instruments, cost_model)
    if why_not:
        raise NotCacheable(why_not)
    try:
        return _digest(model, inputs_key, passes, loss_fn, backend, verify, options)
    except NotCacheable:
        raise
    except Exception as e:  # a model whose classes have no source file (a notebook), a config that fails
        raise NotCacheable(f"the key could not be computed: {type(e).__name__}: {e}") from e


def _digest(model, inputs_key, passes, loss_fn, backend, verify, options) -> str:
    loss = None if loss_fn is None else [describe(loss_fn), file_digest(inspect.getsourcefile(loss_fn))]
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    # the card and triton too: fuse may have chosen its kernels by timing them there (kernel_choice)
    parts = [FORMAT, environment(device), sys.version, _picofx_sources(passes), model_description(model), model.training,
             inputs_key, loss, backend, verify, describe(options), torch.get_default_dtype(),
             [(pass_name(p), describe(p)) for p in passes], [describe(rule) for rule in registered_rules()]]
    return hashlib.sha256(pickle.dumps(repr(parts))).hexdigest()[:32]


def _not_cacheable(model, passes, verify, instruments, cost_model) -> str | None:
    for p in passes:
        name = pass_name(p)
        info = pass_info(p)
        if info.communicates or info.mesh_dims or info.splits_graph:
            return f"pass {name!r} is distributed (bound to process groups)"
        if info.measures:
            return f"pass {name!r} measures a real step"
        if runs_at(p, Stage.PARTITIONED):
            return f"pass {name!r} runs on the partitioned graphs"
    if verify == "numerics":
        return "verify='numerics' checks every pass as it runs"
    if cost_model is not None:
        return "a cost model was given"
    if any(not isinstance(i, Progress) for i in instruments):
        return "an instrument (dump_dir, or one of yours) watches every pass"
    tensors = [*model.parameters(), *model.buffers()]
    if any(isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta" for t in tensors):
        return "the model is on fake tensors or the meta device"
    return None


# ---- graphs as data --------------------------------------------------------------------------

def _kept_meta(node: fx.Node) -> dict:
    kept = {}
    for key, value in node.meta.items():
        if key in VOLATILE_META:
            continue
        try:
            pickle.dumps(value)
        except Exception:  # a stack of frames, a local class: not needed to run the graph
            continue
        kept[key] = value
    return kept


def dump_graph(gm: fx.GraphModule) -> dict:
    nodes, tensors = [], {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            raise NotCacheable(f"node {node.name} calls a submodule")
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch._subclasses.FakeTensor) or not isinstance(value, torch.Tensor):
                raise NotCacheable(f"the graph holds {node.target}, which is not a real tensor")
            tensors[node.target] = value.detach().clone()
        try:
            nodes += node_records([node], _kept_meta)
        except TypeError as e:
            raise NotCacheable(f"node {node.name} calls {node.target!r}, which cannot be named for the cache") from e
    with warnings.catch_warnings():  # pickling a pytree spec's leaves trips torch's LeafSpec deprecation
        warnings.filterwarnings("ignore", category=FutureWarning)
        codegen = pickle.dumps(gm.graph._codegen)
    # the nodes go as pickle's bytes: torch.save's pickler refuses some of their arguments
    # (a torch.memory_format, as a clone in Hugging Face's attention has), which pickle takes
    return {"nodes": pickle.dumps(nodes), "tensors": tensors, "codegen": codegen}


def load_graph(data: dict) -> fx.GraphModule:
    graph = fx.Graph()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        graph._codegen = pickle.loads(data["codegen"])
    root = nn.Module()
    for name, tensor in data["tensors"].items():
        root.register_buffer(name, tensor)
    add_nodes(graph, _unpickled(data["nodes"]))
    return fx.GraphModule(root, graph)


# ---- joint-stage decisions ---------------------------------------------------------------------

class JointMismatch(Exception):
    """The joint graph traced from a cached forward graph is not the one the entry recorded."""


class JointDecisions:
    """What the joint-stage passes did to the joint graph, when all they did was annotate nodes
    (checkpoint's recompute tags): recorded on a miss, replayed on a hit."""

    def __init__(self, replay: dict | None = None):
        self.replaying = replay is not None
        self.fingerprint, self.annotations = (replay["fingerprint"], replay["annotations"]) if replay else (None, {})
        self.replayable = True
        self._before: dict = {}

    @staticmethod
    def _fingerprint(gm: fx.GraphModule) -> list:
        return [(n.name, n.op, str(n.target), str(n.args)) for n in gm.graph.nodes]

    def before_passes(self, gm: fx.GraphModule) -> None:
        self.fingerprint = self._fingerprint(gm)
        self._before = {n.name: dict(n.meta) for n in gm.graph.nodes}

    def after_passes(self, gm: fx.GraphModule) -> None:
        if self._fingerprint(gm) != self.fingerprint:
            self.replayable = False  # a pass changed the graph's structure: only annotations replay
            return
        for node in gm.graph.nodes:
            old = self._before.get(node.name, {})
            changed = {k: v for k, v in node.meta.items() if k not in VOLATILE_META and old.get(k, self) is not v}
            if changed:
                self.annotations[node.name] = changed

    def replay(self, gm: fx.GraphModule) -> None:
        if self._fingerprint(gm) != self.fingerprint:
            raise JointMismatch("the joint graph differs from the cached one")
        for node in gm.graph.nodes:
            node.meta.update(self.annotations.get(node.name, {}))

    def to_data(self) -> dict:
        return {"fingerprint": self.fingerprint, "annotations": self.annotations}


# ---- the store -------------------------------------------------------------------------------

def default_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "picofx"


class GraphCache:
    """Entries as files `<key>.pt` in `directory`. Unreadable, stale or mismatched entries are
    ignored (and rewritten by the run that ignored them). A save writes `<key>.<pid>.tmp` first;
    one left by a process that died while writing is removed when the cache is next opened."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.remove_partial_files()

    def remove_partial_files(self) -> None:
        """Delete the `<key>.<pid>.tmp` files whose writer no longer runs on this machine."""
        if os.name != "posix":  # os.kill(pid, 0) asks whether a process runs only on POSIX
            return
        for partial in self.directory.glob("*.*.tmp"):
            pid = partial.name.split(".")[1]
            if pid.isdigit() and not _running(int(pid)):
                partial.unlink(missing_ok=True)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.pt"

    def forget(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def load(self, key: str) -> tuple[dict | None, str]:
        """(the entry, or None; what happened, for the report)."""
        path = self.path(key)
        if not path.exists():
            return None, "miss"
        try:
            entry = torch.load(path, weights_only=False)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
                return None, "miss (a stale entry, rewritten)"
            entry["graph_module"] = load_graph(entry["graph"])
            return entry, ("hit: capture and passes skipped (the pass rows are those of the run that saved "
                           f"{path.name})")
        except Exception as e:  # a torn or corrupt file, or one from other code
            return None, f"miss (an unreadable entry, rewritten: {type(e).__name__})"

    def save(self, key: str, gm: fx.GraphModule, signature, records: list, joint: JointDecisions) -> str:
        """Write the entry; the report's words for what happened."""
        if not joint.replayable:
            return "not saved: a joint-stage pass changed the graph's structure"
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=FutureWarning)
                entry = {"format": FORMAT, "key": key, "graph": dump_graph(gm), "signature": pickle.dumps(signature),
                         "records": pickle.dumps(records), "joint": joint.to_data()}
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = self.path(key).with_suffix(f".{os.getpid()}.tmp")
            try:
                torch.save(entry, partial)
                os.replace(partial, self.path(key))  # readers never see half a file
            finally:
                partial.unlink(missing_ok=True)  # a save that failed half way leaves nothing behind
        except NotCacheable as e:
            return f"not saved: {e}"
        except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
            return f"not saved: {type(e).__name__}: {e}"
        return f"saved to {self.path(key)}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _unpickled(data: bytes):
    with warnings.catch_warnings():  # a pytree spec's leaves trip torch's LeafSpec deprecation
        warnings.filterwarnings("ignore", category=FutureWarning)
        return pickle.loads(data)


def cached_records(entry: dict) -> list:
    return _unpickled(entry["records"])


def cached_signature(entry: dict):
    return _unpickled(entry["signature"])


def prepared_graph(entry: dict, inputs: list, signature) -> fx.GraphModule:
    """The entry's forward graph, its placeholders given fake values like `inputs`, annotated."""
    gm = entry["graph_module"]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, inputs):
        node.meta["val"] = mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
    gm.meta[SIGNATURE_META] = signature
    annotate(gm)
    return gm
