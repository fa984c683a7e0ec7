"""Precision(float8=...): the linear layers float8_choice picks compute in float8.

After the casts of the compute dtype are in the graph, each linear layer is a matmul of an
activation and the transpose of a weight (`mm(x, t(w))`, or `addmm(bias, x, t(w))`, w derived
from parameters only). A chosen one becomes `float8_linear(x, w, recipe)` (plus the bias), whose
forward and backward matmuls are `_scaled_mm` calls on dynamically scaled float8 casts
(float8_linear.py). The fused linear + cross-entropy of `fuse` keeps its projection in the
compute dtype: it is no matmul node here, and the notes say so.
"""
from __future__ import annotations

import dataclasses
import operator
import warnings

import torch
from torch import fx

from picofx.capture.annotate import fake_mode_of
from picofx.capture.vocabulary import FLOAT8_META, input_slot, is_view, module_path
from picofx.parallel.layouts import layouts_of
from picofx.passes.precision.casts import is_plain_cast
from picofx.passes.precision.float8_choice import Choice, Linear, choose
from picofx.passes.precision.float8_linear import RECIPES, float8_linear
from picofx.passes.precision.rules import op_name

aten = torch.ops.aten
TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}
LAYER_CHOICES = ("auto", "all")
FLOAT8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 matmuls


def check_options(recipe, layers) -> None:
    """Refuse unknown recipes and layer selections when the pass is built."""
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"Precision: float8={recipe!r} is not a recipe; use one of {', '.join(RECIPES)} "
                         "(torchao's names).")
    if isinstance(layers, str):
        if layers not in LAYER_CHOICES:
            raise ValueError(f"Precision: float8_layers={layers!r}; use 'auto', 'all' or a list of module-path "
                             "globs (['layers.*.feed_forward.*']).")
    elif not (isinstance(layers, (list, tuple)) and layers and all(isinstance(g, str) for g in layers)):
        raise ValueError(f"Precision: float8_layers={layers!r}; use 'auto', 'all' or a non-empty list of "
                         "module-path globs.")


def check_device(device: torch.device) -> None:
    """Float8 matmuls need compute capability 8.9 (Ada, Hopper); the CPU runs them emulated."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FLOAT8_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise ValueError(f"Precision(float8=...): {name} (compute capability {capability[0]}.{capability[1]}) "
                             "has no float8 matmuls (they need 8.9: Ada, Hopper or newer); drop float8 there.")
    elif device.type == "cpu":
        warnings.warn("Precision(float8=...) on the CPU: _scaled_mm runs there for numerics (tests, "
                      "comparisons), not for speed.", stacklevel=3)


def linear_operands(node: fx.Node, activation_dependent: set) -> tuple | None:
    """(x, w, bias) when `node` is linear(x, w, bias), mm(x, t(w)) or addmm(bias, x, t(w)), through
    the compute dtype's casts of w (or of its transpose), with w a 2-D value of parameters only:
    the master weight, which the float8 cast reads directly (as torchao's float8 linear does under
    autocast)."""
    if node.target is aten.linear.default:
        x, w, bias = (*node.args, None)[:3]
    else:
        if node.target is aten.mm.default:
            (x, wt), bias = node.args, None
        elif node.target is aten.addmm.default and not node.kwargs:
            bias, x, wt = node.args
        else:
            return None
        wt = _uncast(wt)
        if not (isinstance(wt, fx.Node) and wt.op == "call_function" and wt.target in TRANSPOSES):
            return None
        if wt.target is aten.permute.default and list(wt.args[1]) != [1, 0]:
            return None
        w = wt.args[0]
    w = _uncast(w)
    if w in activation_dependent or x not in activation_dependent or w.meta["val"].dim() != 2:
        return None
    return x, w, bias


def _uncast(node):
    while isinstance(node, fx.Node) and is_plain_cast(node):
        node = node.args[0]
    return node


def activation_dependent_nodes(gm: fx.GraphModule) -> set:
    """Nodes that depend on some graph input that is not a parameter or buffer."""
    dependent = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            slot = input_slot(node)
            if slot is None or slot.kind not in ("parameter", "buffer"):
                dependent.add(node)
        elif any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def find_linears(gm: fx.GraphModule) -> list[tuple[fx.Node, tuple, Linear]]:
    """(matmul node, its (x, w, bias), Linear) for each linear layer; the last one in the graph with
    no matmul after it is the output projection."""
    dependent = activation_dependent_nodes(gm)
    found = []
    for node in gm.graph.nodes:
        operands = linear_operands(node, dependent) if node.op == "call_function" else None
        if operands is not None:
            n, k = operands[1].meta["val"].shape
            found.append([node, operands, Linear(node.name, module_path(node), node.meta["val"].numel() // n, k, n,
                                                 False, _amax_fuses_with_producer(operands[0]))])
    if found and not _matmul_after(found[-1][0]):
        found[-1][2] = dataclasses.replace(found[-1][2], output_projection=True)
    return [tuple(f) for f in found]


def _amax_fuses_with_producer(x: fx.Node) -> bool:
    """Whether the kernel producing x (through views and casts) can also take its amax: not attention's."""
    while isinstance(x, fx.Node) and (is_plain_cast(x) or is_view(x) or x.target is operator.getitem):
        x = x.args[0]
    return not (isinstance(x, fx.Node) and x.op == "call_function" and "attention" in (op_name(x.target) or ""))


def _matmul_after(node: fx.Node) -> bool:
    seen, todo = set(), list(node.users)
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        if op_name(user.target) in ("aten.mm", "aten.addmm", "aten.linear") or user.target is float8_linear:
            return True
        todo.extend(user.users)
    return False


def rewrite_to_float8(gm: fx.GraphModule, recipe: str, layers, device_description) -> dict[str, Choice]:
    """Replace each chosen linear layer by float8_linear; returns "node (module path)" -> Choice."""
    mode = fake_mode_of(gm)
    choices = {}
    splits, group = tensor_parallel_splits(gm)
    for node, (x, w, bias), linear in find_linears(gm):
        choice = choose(linear, layers, recipe, device_description)
        choices[f"{node.name} ({linear.path or 'top level'})"] = choice
        if not choice.float8:
            continue
        split = splits.get(input_slot(w).target) if w.op == "placeholder" and input_slot(w) else None
        args = (x, w, recipe) if split is None else (x, w, recipe, split, group)
        with gm.graph.inserting_before(node):
            f8 = gm.graph.call_function(float8_linear, args)
            result = f8 if bias is None else gm.graph.call_function(aten.add.Tensor, (f8, bias))
        with mode:
            f8.meta["val"] = float8_linear(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
            if result is not f8:
                result.meta["val"] = aten.add.Tensor(f8.meta["val"], bias.meta["val"])
        for new in {f8, result}:
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        f8.meta[FLOAT8_META] = recipe  # what the shard pass (gathers) and the compiler (CPU roundings) read
        unused = list(node.all_input_nodes)
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        while unused:  # the transpose and casts of the weight no other node reads
            value = unused.pop()
            if isinstance(value, fx.Node) and not value.users and value.op == "call_function":
                unused.extend(value.all_input_nodes)
                gm.graph.erase_node(value)
    gm.recompile()
    return choices


def tensor_parallel_splits(gm: fx.GraphModule) -> tuple[dict, str | None]:
    """Under pass tensor_parallel: {parameter name: "colwise" | "rowwise"} for the weights split over
    the tp ranks, and their group, so that each float8 cast scales by the whole weight's amax."""
    layout = layouts_of(gm).tensor_parallel
    if layout is None or layout.world == 1:
        return {}, None
    return {e.name: e.style for e in layout.entries if e.style in ("colwise", "rowwise")}, layout.dim.group_name


def fused_loss_note(gm: fx.GraphModule) -> str | None:
    if any(op_name(n.target) == "picofx.linear_cross_entropy" for n in gm.graph.nodes if n.op == "call_function"):
        return "the output projection inside fuse's linear_cross_entropy stays in the compute dtype"
    return None
