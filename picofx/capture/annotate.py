"""Node annotations every pass can rely on, kept true by the pass manager after each pass.

node.meta["val"]          fake tensor (or tuple of them): shape, dtype, device
node.meta["flops"]        FLOPs of the node, from torch.utils.flop_counter's formulas
node.meta["bytes"]        bytes of the node's tensor outputs
node.meta["module_path"]  the module the node came from, e.g. "model.layers.3.mlp.down_proj"
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import picofx.capture.flops  # noqa: F401  (registers the CPU attention formulas)
from picofx.capture.vocabulary import MODULE_PATH_META, module_path


def tensor_bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


class _AnnotatingInterpreter(fx.Interpreter):
    """Runs the graph on fake values under one FlopCounterMode (entering a mode per node costs
    more than most nodes' propagation): a node's FLOPs are what the count grew by while it ran."""

    def __init__(self, gm: fx.GraphModule, counter: FlopCounterMode):
        super().__init__(gm)
        self.counter = counter

    def fetch_attr(self, target: str):  # a tensor the graph holds (a pass's buffer): its fake value
        value = super().fetch_attr(target)
        mode = detect_fake_mode()
        return mode.from_tensor(value) if mode is not None and isinstance(value, torch.Tensor) else value

    def run_node(self, node: fx.Node):
        if node.op in ("placeholder", "output"):
            return super().run_node(node)
        before = self.counter.get_total_flops()
        value = super().run_node(node)
        node.meta["val"] = value
        node.meta["flops"] = self.counter.get_total_flops() - before
        node.meta["bytes"] = tensor_bytes(value)
        return value


def fake_mode_of(gm: fx.GraphModule) -> FakeTensorMode:
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return detect_fake_mode(vals) or FakeTensorMode(allow_non_fake_inputs=True)


def annotate(gm: fx.GraphModule) -> None:
    """(Re)compute val, flops and bytes of every node by propagating the placeholders' fake values;
    give nodes a pass created without a module path the path their inputs share."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    missing = [n.name for n in placeholders if "val" not in n.meta]
    if missing:
        raise ValueError(f"annotate: placeholders {missing} have no meta['val']; a pass that adds a "
                         "graph input must set its fake value.")
    mode = fake_mode_of(gm)
    inputs = [_as_fake(mode, n.meta["val"]) for n in placeholders]
    with mode, FlopCounterMode(display=False) as counter:
        _AnnotatingInterpreter(gm, counter).run(*inputs)
    for node in placeholders:
        node.meta["flops"], node.meta["bytes"] = 0, tensor_bytes(node.meta["val"])
    for node in gm.graph.nodes:
        if MODULE_PATH_META not in node.meta:
            node.meta[MODULE_PATH_META] = common_module_path(node.all_input_nodes)


def _as_fake(mode: FakeTensorMode, value):
    if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
        return mode.from_tensor(value)
    return value


def common_module_path(nodes) -> str:
    """The module all the nodes come from (ignoring nodes that come from none)."""
    paths = [module_path(n).split(".") for n in nodes if module_path(n)]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
