"""Rewrite a graph to a per-node dtype plan: insert casts, shared by every user, and retype nodes.

`insert_casts(gm, plan, rounded_after)` walks the graph in order. A planned node gets each floating
input cast to its dtype; the cast of a value to a dtype is made once, before its first user, and shared
by all later users (so a weight is cast once per step, and the backward reuses the forward's
cast through autograd). A planned node in `rounded_after` keeps its inputs and gets its `out_dtype`
argument set to its dtype instead (the fused norms: fp32 inside, one rounding of the output).
Unplanned nodes follow their inputs' new dtypes by ATen type promotion; an op that needs equal
dtypes (index_put, scatter) gets its inputs cast to their promotion.
Ops outside ATen and picofx (a library's custom op, such as an MoE grouped matmul, or a user's
own) are not known to accept other dtypes: their inputs are cast back, at the op's boundary, to
the dtypes they were captured with, unless the plan names the op. Graph outputs keep the dtypes
they were captured with, so the step's results look as before. An op that does not accept its
new input dtypes is reported when the pass runs, naming the node.
"""
from __future__ import annotations

import math

from collections import Counter

import torch
import torch.utils._pytree as pytree
from torch import fx

from picofx.capture.annotate import fake_mode_of
from picofx.passes.precision.rules import EQUAL_DTYPE_OPS, LOW_PRECISION, is_float_tensor, op_name
from picofx.capture.vocabulary import input_slot, module_path

CAST = torch.ops.aten._to_copy.default
SHORT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
CASTABLE = (torch.bfloat16, torch.float16, torch.float32)  # fp64 values are left as the model made them


def dtype_of(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _dtypes(val) -> list:
    return [t.dtype for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]


def is_plain_cast(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is CAST and set(node.kwargs) == {"dtype"}


class CastInserter:
    def __init__(self, gm: fx.GraphModule):
        self.gm, self.mode = gm, fake_mode_of(gm)
        self.casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.counts: Counter = Counter()  # casts by kind ("weight", "activation", "output"), "loss_upcast"

    def cast(self, src: fx.Node, dtype: torch.dtype, before: fx.Node, kind: str) -> fx.Node:
        # An upcast of a low-precision value, cast back down, is the value itself (bf16 -> fp32 -> bf16).
        if is_plain_cast(src) and dtype_of(src.args[0]) == dtype and dtype in LOW_PRECISION:
            return src.args[0]
        key = (src, dtype)
        if key not in self.casts:
            with self.gm.graph.inserting_before(before):
                name = f"{src.name}_{SHORT_NAMES[dtype]}"
                node = self.gm.graph.create_node("call_function", CAST, (src,), {"dtype": dtype}, name=name)
            with self.mode:
                node.meta["val"] = CAST(src.meta["val"], dtype=dtype)
            node.meta["module_path"] = module_path(src)
            slot = input_slot(src)
            self.counts["weight" if slot is not None and slot.kind == "parameter" else kind] += 1
            self.casts[key] = node
        return self.casts[key]

    def cast_inputs(self, node: fx.Node, wanted) -> bool:
        """Replace node's floating inputs by casts to `wanted(dtype) -> dtype | None`; True if any."""
        changed = False

        def replace(arg):
            nonlocal changed
            dtype = dtype_of(arg)
            target = wanted(dtype) if dtype in CASTABLE else None
            if target is None or target == dtype:
                return arg
            changed = True
            return self.cast(arg, target, node, "activation")

        node.args, node.kwargs = pytree.tree_map_only(fx.Node, replace, (node.args, node.kwargs))
        return changed

    def fake_value(self, node: fx.Node):
        args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
        try:
            with self.mode:
                return node.target(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError) as error:
            _raise_rejected(node, error)


def insert_casts(gm: fx.GraphModule, plan: dict[fx.Node, torch.dtype], rounded_after=frozenset()) -> Counter:
    """Make every node in `plan` compute in its dtype (those in `rounded_after`: write their output in
    it); returns what changed: casts inserted by kind ("weight", "activation", "output"),
    "loss_upcast" (fused losses set to compute in fp32) and "rounded_outputs" (out_dtype set)."""
    inserter = CastInserter(gm)
    output = gm.graph.output_node()
    captured = {n: dtype_of(n) for n in output.all_input_nodes}
    traced_dtypes = {n: dtype_of(n) for n in gm.graph.nodes}
    retyped: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        dtype = plan.get(node)
        changed = False
        if dtype is not None and node in rounded_after:
            changed = _set_argument(node, "out_dtype", dtype)
            inserter.counts["rounded_outputs"] += changed and dtype in LOW_PRECISION
        elif dtype is not None:
            changed = inserter.cast_inputs(node, lambda d, dtype=dtype: dtype)
            if _keep_loss_in_fp32(node):
                inserter.counts["loss_upcast"] += 1
                changed = True
        if not changed and not any(arg in retyped for arg in node.all_input_nodes):
            continue
        if op_name(node.target) in EQUAL_DTYPE_OPS:
            promoted = _promoted(node)
            inserter.cast_inputs(node, lambda d: promoted)
        elif dtype is None and is_foreign_op(node.target):
            _cast_back(inserter, node, traced_dtypes)
        before = _dtypes(node.meta.get("val"))
        node.meta["val"] = inserter.fake_value(node)
        if _dtypes(node.meta["val"]) != before:
            retyped.add(node)
    checked = set()  # each layer repeats the same calls: one real run answers for all of them
    for node in gm.graph.nodes:
        if node.op == "call_function" and _mixed_by_the_pass(node, traced_dtypes):
            call = _call_key(node)
            if call not in checked:
                checked.add(call)
                _check_accepts_dtypes(node)
    restore = {n: d for n, d in captured.items() if d is not None and dtype_of(n) != d}
    if restore:
        output.args = pytree.tree_map_only(
            fx.Node, lambda n: inserter.cast(n, restore[n], output, "output") if n in restore else n, output.args)
    return inserter.counts


def _float_input_dtypes(node: fx.Node, dtypes) -> set:
    return {dtypes(a) for a in node.all_input_nodes if dtypes(a) is not None and dtypes(a).is_floating_point}


def _mixed_by_the_pass(node: fx.Node, traced_dtypes: dict) -> bool:
    """The node now mixes floating dtypes that it did not mix when traced, and is not a pointwise op
    (those promote by ATen's rules)."""
    if not isinstance(node.target, torch._ops.OpOverload) or torch.Tag.pointwise in node.target.tags:
        return False
    now = _float_input_dtypes(node, dtype_of)
    return len(now) > 1 and len(_float_input_dtypes(node, traced_dtypes.get)) == 1


CHECK_BYTES = 8 * 2**20  # the most a dtype check allocates: a larger call runs on halved shapes


def _check_accepts_dtypes(node: fx.Node) -> None:
    """Run the op once on zeros of its inputs' shapes and new dtypes: fake tensors do not check
    dtypes for every op (grid_sample, custom ops), and a rejected dtype should fail here, not at
    the first training step. Inputs past CHECK_BYTES run with every even size above 16 halved
    (alike in every input, so the shapes still agree) until they fit: the check's memory does not
    grow with the sequence; where the op refuses the smaller shapes, the call runs at full size."""
    shapes = [n.meta["val"].shape for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    halvings = 0
    while _zeros_bytes(node, halvings) > CHECK_BYTES and _halved_sizes(shapes, halvings + 1) != _halved_sizes(
            shapes, halvings):
        halvings += 1
    try:
        _call_on_zeros(node, halvings)
    except (RuntimeError, TypeError, ValueError) as error:
        if not halvings:
            _raise_rejected(node, error)
        try:
            _call_on_zeros(node, 0)
        except (RuntimeError, TypeError, ValueError) as error:
            _raise_rejected(node, error)


def _halved(size: int, halvings: int) -> int:
    for _ in range(halvings):
        size = size // 2 if size > 16 and size % 2 == 0 else size
    return size


def _halved_sizes(shapes, halvings: int) -> list:
    return [tuple(_halved(s, halvings) for s in shape) for shape in shapes]


def _zeros_bytes(node: fx.Node, halvings: int) -> int:
    return sum(math.prod(_halved(s, halvings) for s in n.meta["val"].shape) * n.meta["val"].element_size()
               for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor))


def _call_on_zeros(node: fx.Node, halvings: int) -> None:
    def zeros(n):
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return val
        return torch.zeros([_halved(s, halvings) for s in val.shape], dtype=val.dtype)
    args, kwargs = pytree.tree_map_only(fx.Node, zeros, (node.args, node.kwargs))
    with torch.no_grad():
        node.target(*args, **kwargs)


def _call_key(node: fx.Node) -> str:
    """The call `_check_accepts_dtypes` makes for the node (its op, its inputs' shapes and dtypes,
    its other arguments): equal for nodes that would run the same check."""
    def described(n):
        val = n.meta.get("val")
        return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else val
    return repr((node.target, pytree.tree_map_only(fx.Node, described, (node.args, node.kwargs))))


def _raise_rejected(node: fx.Node, error: Exception):
    inputs = ", ".join(f"{a.name}: {SHORT_NAMES.get(dtype_of(a), dtype_of(a))}" for a in node.all_input_nodes
                       if dtype_of(a) is not None)
    where = module_path(node) or "the top level"
    raise TypeError(f"precision: node {node.name} ({node.target}, in {where}) does not accept its inputs' "
                    f"new dtypes ({inputs}): {error}. Keep it in fp32 with "
                    f"Precision(fp32_ops=({op_name(node.target)!r},)) or an override for its module.") from error


def is_foreign_op(target) -> bool:
    """An op from outside ATen, prims and picofx: a library's or a user's custom op."""
    name = op_name(target)
    return name is not None and name.split(".")[0] not in ("aten", "prims", "picofx")


def _cast_back(inserter: CastInserter, node: fx.Node, traced_dtypes: dict) -> None:
    """Cast each input whose dtype the pass changed back to the dtype it was traced with."""
    def replace(arg):
        traced, now = traced_dtypes.get(arg), dtype_of(arg)
        if traced is None or now is None or traced == now or traced not in CASTABLE:
            return arg
        return inserter.cast(arg, traced, node, "activation")

    node.args, node.kwargs = pytree.tree_map_only(fx.Node, replace, (node.args, node.kwargs))


def _promoted(node: fx.Node) -> torch.dtype:
    dtypes = [dtype_of(n) for n in node.all_input_nodes if is_float_tensor(n.meta.get("val"))]
    result = dtypes[0]
    for d in dtypes[1:]:
        result = torch.promote_types(result, d)
    return result


def _keep_loss_in_fp32(node: fx.Node) -> bool:
    """The fused linear + cross-entropy computes its matmul in the compute dtype and its loss in
    fp32 only with upcast=True; set it."""
    return op_name(node.target) == "picofx.linear_cross_entropy" and _set_argument(node, "upcast", True)


def _set_argument(node: fx.Node, name: str, value) -> bool:
    """Set the op's argument `name` (given by position or keyword, or left to its default) to
    `value`; True if that changed it."""
    argument = next(a for a in node.target._schema.arguments if a.name == name)
    index = node.target._schema.arguments.index(argument)
    if len(node.args) > index:
        if node.args[index] == value:
            return False
        node.args = (*node.args[:index], value, *node.args[index + 1:])
        return True
    if node.kwargs.get(name, argument.default_value if argument.has_default_value() else None) == value:
        return False
    node.kwargs = {**node.kwargs, name: value}
    return True
