"""Graphs as text (one row per node) and Graphviz dot, and the instrument that writes them per pass."""
from __future__ import annotations

import os

import torch
import torch.utils._pytree as pytree
from torch import fx

from picofx.capture.vocabulary import input_slot, module_path


def _target(node: fx.Node) -> str:
    if node.op in ("call_function", "call_method"):
        return str(getattr(node.target, "__name__", node.target)) if not isinstance(
            node.target, torch._ops.OpOverload) else str(node.target)
    slot = input_slot(node)
    if slot is not None:
        return f"{slot.kind} {slot.target}"
    return str(node.target) if node.op != "output" else ""


def _shape_dtype(node: fx.Node) -> tuple[str, str]:
    tensors = [t for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
    if not tensors:
        return "", ""
    shapes = ",".join("x".join(str(d) for d in t.shape) or "scalar" for t in tensors)
    dtypes = ",".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors}))
    return shapes, dtypes


def graph_rows(gm: fx.GraphModule) -> list[list[str]]:
    rows = []
    for node in gm.graph.nodes:
        shape, dtype = _shape_dtype(node)
        rows.append([node.name, node.op, _target(node), shape, dtype, str(node.meta.get("flops", "")),
                     str(node.meta.get("bytes", "")), module_path(node)])
    return rows


def graph_text(gm: fx.GraphModule) -> str:
    rows = [["name", "op", "target", "shape", "dtype", "flops", "bytes", "module"]] + graph_rows(gm)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows) + "\n"


def graph_dot(gm: fx.GraphModule) -> str:
    lines = ["digraph G {", "  node [shape=box, fontname=monospace];"]
    for node in gm.graph.nodes:
        shape, dtype = _shape_dtype(node)
        label = f"{node.name}\\n{_target(node)}\\n{shape} {dtype}".replace('"', "'")
        lines.append(f'  "{node.name}" [label="{label}"];')
        lines += [f'  "{arg.name}" -> "{node.name}";' for arg in node.all_input_nodes]
    return "\n".join(lines + ["}"]) + "\n"


class DumpGraphs:
    """Instrument: writes `NN_<label>.txt` (and `.dot`) for the captured graph, every stage's
    entry graph and the graph after every pass."""

    def __init__(self, directory: str, formats=("txt", "dot")):
        unknown = set(formats) - {"txt", "dot"}
        if unknown:
            raise ValueError(f"DumpGraphs: unknown formats {sorted(unknown)}; use 'txt' and/or 'dot'")
        self.directory, self.formats, self.count = directory, tuple(formats), 0
        os.makedirs(directory, exist_ok=True)

    def _write(self, label: str, gm: fx.GraphModule) -> None:
        stem = os.path.join(self.directory, f"{self.count:02d}_{label}")
        if "txt" in self.formats:
            with open(stem + ".txt", "w") as f:
                f.write(graph_text(gm))
        if "dot" in self.formats:
            with open(stem + ".dot", "w") as f:
                f.write(graph_dot(gm))
        self.count += 1

    def on_graph(self, label, gm, ctx) -> None:
        self._write(label, gm)

    def after_pass(self, record, gm, ctx) -> None:
        suffix = "" if record.stage.value == "forward" else f".{record.graph_role}"
        self._write(f"{record.name}{suffix}", gm)
