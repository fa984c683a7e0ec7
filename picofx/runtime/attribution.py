"""Where a step's time went, from a torch.profiler trace: time per graph node, per label of the
nodes (a fused pattern, a module path), per kind of op, and which attention backend each SDPA call
ran. Shared by `tools/bench_gpu.py --profile` and the run breakdown of `picofx train --profile`.

The trace's CPU-side events are walked from their roots; the outermost event that names work is a
unit, timed by the device time of the kernels it launched (CUDA) or by its own span (CPU):
    an ATen or picofx op ("aten::mm", "picofx::rms_norm"): the next node of the graphs, in graph
        order, whose op it is (the graphs run their nodes in order, every step the same);
    an Inductor kernel ("triton_poi_fused_add_mul_3", "cpp_fused_mean_pow_0"): with Inductor's
        `descriptive_names = "inductor_node"` its name lists the graph nodes it fused, matched
        against the graphs' node names (the longest first); otherwise its ATen op names only;
    anything else (a graph call, an optimizer step) is walked through to its children.
A unit matched to no node still gets a kind (`kind_of`: matmul, attention, rms_norm, ...), so
two contenders' traces compare kind by kind even where one has no graph (torch.compile). What no
unit covers is reported as unattributed.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

from torch import fx

from picofx.capture.vocabulary import traced_module_path

KERNEL = re.compile(r"^(?:triton|cpp)_(?:[a-z]+_)?fused_(?P<names>.*?)(?:_\d+)?$")
SDPA_BACKENDS = (("_flash_attention_for_cpu", "flash (cpu)"), ("_flash_attention", "flash"),
                 ("_efficient_attention", "efficient"), ("_cudnn_attention", "cudnn"),
                 ("_attention_math", "math"), ("_scaled_dot_product_attention_math", "math"))
# What a kernel's op names say it does: the first kind whose words all appear in them.
KINDS = (("loss", ("linear_cross_entropy",)), ("loss", ("log_softmax",)), ("loss", ("nll_loss",)),
         ("attention", ("scaled_dot_product",)), ("attention", ("attention",)),
         ("rms_norm", ("rms_norm",)), ("rms_norm", ("rsqrt",)), ("swiglu", ("silu",)), ("swiglu", ("sigmoid", "mul")),
         ("rope", ("rope",)), ("rope", ("neg", "cat")), ("rope", ("cos", "sin")),
         ("optimizer", ("adam",)), ("optimizer", ("foreach",)), ("matmul", ("mm",)), ("matmul", ("addmm",)),
         ("matmul", ("bmm",)), ("embedding", ("embedding",)), ("copy", ("copy",)), ("copy", ("cat",)))


def kind_of(name: str) -> str:
    """A word of 4 letters or more is looked for anywhere in the name, a shorter one ("mm", "mul")
    as a whole word between underscores, colons or dots."""
    lowered = name.lower()
    words = set(re.split(r"[_:.\s]+", lowered))
    for kind, needed in KINDS:
        if all(w in lowered if len(w) >= 4 else w in words for w in needed):
            return kind
    return "other"


def sdpa_backend(name: str) -> str | None:
    if "attention" not in name:
        return None
    return next((backend for marker, backend in SDPA_BACKENDS if marker in name), None)


@dataclass
class Attribution:
    seconds: float = 0.0  # every root event's span (the traced steps)
    by_node: dict = field(default_factory=lambda: defaultdict(float))  # "graph.node" -> seconds
    by_label: dict = field(default_factory=lambda: defaultdict(float))  # label -> seconds
    by_kind: dict = field(default_factory=lambda: defaultdict(float))  # kind_of -> seconds
    sdpa: Counter = field(default_factory=Counter)  # backend -> calls
    unmatched: float = 0.0  # seconds of units matched to no node (they count in by_kind)

    @property
    def attributed(self) -> float:
        return sum(self.by_kind.values())

    @property
    def unattributed(self) -> float:
        return max(0.0, self.seconds - self.attributed)

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "attributed": self.attributed, "unattributed": self.unattributed,
                "unmatched": self.unmatched, "by_label": dict(self.by_label), "by_kind": dict(self.by_kind),
                "by_node": dict(self.by_node), "sdpa": dict(self.sdpa)}


def default_label(node: fx.Node) -> str:
    """The fused pattern the node belongs to (`picofx.planner.pattern_bytes` tags), else its module
    path, else the kind of its op (the nodes a rule inserted carry no module stack)."""
    return ((node.meta.get("custom") or {}).get("fused_pattern") or traced_module_path(node)
            or kind_of(getattr(node.target, "__name__", str(node.target))))


class _Nodes:
    """The graphs' nodes by op name (queues in graph order, cycled: every step runs them again) and
    by name within each graph; a node is known as "graph.name"."""

    def __init__(self, graphs):
        graphs = graphs if isinstance(graphs, dict) else {f"graph{i}": gm for i, gm in enumerate(graphs)}
        self.by_op: dict[str, deque] = defaultdict(deque)
        self.by_name: dict[str, dict[str, fx.Node]] = {}
        self.key: dict[fx.Node, str] = {}
        for role, gm in graphs.items():
            self.by_name[role] = {}
            for node in gm.graph.nodes:
                if node.op == "call_function" and hasattr(node.target, "_schema"):
                    self.by_op[node.target._schema.name].append(node)
                    self.by_name[role][node.name] = node
                    self.key[node] = f"{role}.{node.name}"

    def next_of(self, op: str) -> list[fx.Node]:
        queue = self.by_op.get(op)
        if not queue:
            return []
        queue.rotate(-1)
        return [queue[-1]]

    def named_in(self, names: str) -> list[fx.Node]:
        """The nodes a kernel's name lists, from the graph where most of them are found."""
        best = []
        for by_name in self.by_name.values():
            found, rest = [], f"_{names}_"
            for name in sorted(by_name, key=len, reverse=True):
                if f"_{name}_" in rest:
                    found.append(by_name[name])
                    rest = rest.replace(f"_{name}_", "_", 1)
            best = max(best, found, key=len)
        return best


def _seconds(event) -> float:
    device = getattr(event, "device_time_total", 0) or 0
    return (device if device > 0 else event.cpu_time_total) / 1e6


def _is_unit(name: str) -> bool:
    return name.startswith(("aten::", "picofx::")) or KERNEL.match(name) is not None


def attribute(events, graphs=(), label=default_label) -> Attribution:
    """`events`: a torch.profiler profile's `events()`; `graphs`: the GraphModules that ran, by role
    ({"forward": gm, "backward": gm}) or in a list (none for a contender without graphs); `label(node)`: what to sum time by (default: the fused
    pattern a node belongs to, else its module path)."""
    nodes, result = _Nodes(graphs), Attribution()
    roots = [e for e in events if e.cpu_parent is None and getattr(e, "device_type", None) is not None
             and str(e.device_type).endswith("CPU")]
    result.seconds = sum(_seconds(e) for e in roots if _is_unit(e.name) or e.cpu_children)

    def unit(event) -> None:
        seconds, name = _seconds(event), event.name
        backend = sdpa_backend(name)
        if backend:
            result.sdpa[backend] += 1
        match = KERNEL.match(name)
        owners = nodes.named_in(match.group("names")) if match else nodes.next_of(name)
        result.by_kind[kind_of(name)] += seconds
        if not owners:
            result.unmatched += seconds
            return
        for node in owners:  # a fused kernel's time is shared equally among the nodes it names
            result.by_node[nodes.key[node]] += seconds / len(owners)
            result.by_label[label(node)] += seconds / len(owners)

    stack = list(reversed(roots))
    while stack:
        event = stack.pop()
        if _is_unit(event.name):
            unit(event)
        else:
            stack.extend(reversed(event.cpu_children))
    return result


def table(attributions: dict[str, dict], by: str = "by_kind") -> str:
    """Milliseconds per step for each kind (or label) of work, contenders side by side, from
    `Attribution.as_dict()` results (with "steps": how many steps each traced, default 1)."""
    keys = sorted({k for a in attributions.values() for k in a[by]})
    per_step = {n: a.get("steps", 1) for n, a in attributions.items()}
    rows = [["ms per step", *attributions]]
    rows += [[k, *(f"{a[by].get(k, 0.0) * 1e3 / per_step[n]:.2f}" for n, a in attributions.items())] for k in keys]
    rows.append(["unattributed", *(f"{a['unattributed'] * 1e3 / per_step[n]:.2f}" for n, a in attributions.items())])
    rows.append(["sdpa backends", *(", ".join(f"{b} x{c}" for b, c in a["sdpa"].items()) or "-"
                                    for a in attributions.values())])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
