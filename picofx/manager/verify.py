"""What the manager checks after every pass: picofx's invariants, and optionally numerics."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import fx

from picofx.errors import VerificationError
from picofx.capture.vocabulary import SIGNATURE_META, input_slot

FP32_TOLERANCE = (1e-5, 1e-6)  # (rtol, atol): the same math in fp32, rounding aside
ANNOTATIONS = ("val", "flops", "bytes", "module_path")


def check_structure(graph: fx.Graph) -> None:
    """The graph is a well-formed DAG in order: one output node, last; every node's inputs are live
    nodes of this graph defined before it; each node's `users` are exactly the live nodes that
    take it. Passes that edit nodes through private fields, erase a node under its users or
    rewire a node to its own output break these, and torch fails on them much later."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    outputs = [node for node in order if node.op == "output"]
    if len(outputs) != 1 or order[outputs[0]] != len(order) - 1:
        where = "" if len(outputs) != 1 else f", {outputs[0].name} before other nodes"
        raise VerificationError(f"the graph has {len(outputs)} output nodes{where}; it needs exactly one, last: "
                                "keep the output node and change its args instead of adding or moving one.")
    for node, position in order.items():
        if node.graph is not graph:
            raise VerificationError(f"node {node.name} belongs to another graph; copy nodes in with "
                                    "graph.node_copy(node, arg_transform) or graph.graph_copy.")
        for arg in node.all_input_nodes:
            if arg.graph is not graph:
                raise VerificationError(f"node {node.name} takes {arg.name}, a node of another graph; copy nodes in "
                                        "with graph.node_copy(node, arg_transform) so that their inputs are this "
                                        "graph's nodes.")
            if arg not in order:
                raise VerificationError(f"node {node.name} takes {arg.name}, which is no longer in the graph (erased "
                                        f"while {node.name} still used it); give its users a replacement first "
                                        f"({arg.name}.replace_all_uses_with(new)), then graph.erase_node({arg.name}).")
            if order[arg] >= position:
                raise VerificationError(_describe_late_input(node, arg, order))
            if node not in arg.users:
                raise VerificationError(f"node {node.name} takes {arg.name}, but {arg.name}.users does not list it: "
                                        "set node.args / node.kwargs (or node.replace_input_with), never their "
                                        "private fields.")
        for user in node.users:
            if user not in order:
                raise VerificationError(f"node {node.name} lists {user.name} among its users, but {user.name} is no "
                                        f"longer in the graph: remove nodes only with graph.erase_node.")
            if node not in user.all_input_nodes:
                raise VerificationError(f"node {node.name} lists {user.name} among its users, but {user.name} does "
                                        "not take it: set node.args / node.kwargs, never their private fields.")


def _describe_late_input(node: fx.Node, arg: fx.Node, order: dict) -> str:
    """Why `node` takes `arg`, defined after it: a cycle through `node` (named), or only order."""
    parent = {arg: None}
    frontier = [arg]
    while frontier and node not in parent:
        current = frontier.pop()
        for source in current.all_input_nodes:
            if source in order and source not in parent:
                parent[source] = current
                frontier.append(source)
    if node not in parent:
        return (f"node {node.name} takes {arg.name}, which comes after it in the graph; create nodes under "
                f"graph.inserting_before({node.name}) or move them with {node.name}.prepend({arg.name}).")
    path, current = [node], parent[node]  # node -> ... -> arg, following users from node
    while current is not None:
        path.append(current)
        current = parent[current]
    cycle = " -> ".join(n.name for n in [*path, node])
    return (f"the graph has a cycle: {cycle} (each takes the one before it); a rewrite made "
            f"{node.name} depend on its own output: check that a replacement's inputs do not depend on "
            "the nodes it replaces.")


def check_invariants(gm: fx.GraphModule, ctx) -> None:
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        missing = [key for key in ANNOTATIONS if key not in node.meta]
        if missing:
            raise VerificationError(f"node {node.name} ({node.op} {node.target}) lacks meta {missing}; "
                                    "annotate(gm) after adding nodes, or give new nodes a fake 'val'.")
    own = [name for name, _ in gm.named_parameters()]
    if own:
        raise VerificationError(f"the graph holds parameters of its own {own[:3]}: a pass copied model "
                                "weights. Take them as placeholders (the model's own tensors) instead.")
    signature = gm.meta.get(SIGNATURE_META)
    if signature is None:
        return
    slots = [input_slot(n) for n in gm.graph.nodes if n.op == "placeholder"]
    if slots != signature.inputs:
        raise VerificationError("the graph's placeholders no longer match the captured inputs "
                                "(parameters, buffers, user inputs); passes must not add, drop or reorder them.")
    for slot, value in zip(slots, ctx.example_inputs):
        if slot.kind == "parameter" and value is not ctx.model.get_parameter(slot.target):
            raise VerificationError(f"input {slot.target} is no longer the model's own parameter.")


def _leaf_copies(inputs):
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) and
            x.is_floating_point() else x for x in inputs]


def _flat(value) -> list:
    return pytree.tree_leaves(value, is_leaf=lambda x: x is None)  # keep None outputs in place


def dropped_outputs(gm: fx.GraphModule) -> set[int]:
    """Positions of outputs a pass replaced by None (e.g. logits a fused loss never materializes)."""
    return {i for i, arg in enumerate(_flat(gm.graph.output_node().args[0])) if arg is None}


def _run(gm: fx.GraphModule, inputs, with_grad: bool, dropped: set[int]):
    leaves = _leaf_copies(inputs) if with_grad else inputs
    with torch.set_grad_enabled(with_grad):
        outputs = _flat(fx.Interpreter(gm).run(*leaves))  # flat placeholders, whatever the codegen
    grads = []
    if with_grad:
        total = 0
        for i, out in enumerate(outputs):
            if i in dropped or not (isinstance(out, torch.Tensor) and out.requires_grad):
                continue
            # one generator per output position: the same cotangent whatever the other outputs are
            cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(i)).to(out.device)
            total = total + (out.float() * cotangent).sum()
        wrt = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
        if torch.is_tensor(total):
            grads = torch.autograd.grad(total, wrt, allow_unused=True)
    return outputs, grads


def check_numerics(before: fx.GraphModule, after: fx.GraphModule, ctx, tolerance=None, *, normwise=False) -> None:
    """Run both graphs on the example inputs; outputs (and, for forward graphs, the gradients of
    every input that requires grad) must agree within `tolerance` (default: fp32's), element by
    element, or with `normwise` tensor by tensor (for low precision, where values of very
    different sizes share one tolerance)."""
    close = _close_normwise if normwise else _close
    rtol, atol = tolerance or FP32_TOLERANCE
    with_grad = ctx.stage.value == "forward"
    dropped = dropped_outputs(after)
    out_b, grads_b = _run(before, ctx.example_inputs, with_grad, dropped)
    out_a, grads_a = _run(after, ctx.example_inputs, with_grad, dropped)
    if len(out_b) != len(out_a):
        raise VerificationError(f"the graph returns {len(out_a)} values instead of {len(out_b)}.")
    for i, (b, a) in enumerate(zip(out_b, out_a)):
        if i in dropped or not isinstance(b, torch.Tensor):
            continue
        close(a, b, rtol, atol, f"output {i}")
    names = [_input_name(n) for n, x in zip(_placeholders(after), ctx.example_inputs)
             if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad]
    for name, b, a in zip(names, grads_b, grads_a):
        if a is None and b is None:
            continue
        if a is None or b is None:
            raise VerificationError(f"the gradient of {name} is {'missing' if a is None else 'new'} after the pass.")
        close(a, b, rtol, atol, f"the gradient of {name}")


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _input_name(node: fx.Node) -> str:
    slot = input_slot(node)
    return slot.target if slot is not None and slot.kind != "user" else node.name


def _same_kind(actual, expected, what: str) -> None:
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise VerificationError(f"{what} changed from {tuple(expected.shape)} {expected.dtype} to "
                                f"{tuple(actual.shape)} {actual.dtype}.")


def _close_normwise(actual, expected, rtol, atol, what: str) -> None:
    _same_kind(actual, expected, what)
    error = (actual.double() - expected.double()).norm().item()
    size = expected.double().norm().item()
    if not error <= rtol * size + atol:  # also false for nan
        raise VerificationError(f"{what} differs: ||error|| = {error:.3g} against ||expected|| = {size:.3g} "
                                f"(relative {error / max(size, 1e-30):.3g}; rtol {rtol:g}, atol {atol:g}, norm-wise).")


def _close(actual, expected, rtol, atol, what: str) -> None:
    _same_kind(actual, expected, what)
    if not torch.allclose(actual.float(), expected.float(), rtol=rtol, atol=atol, equal_nan=True):
        diff = (actual.float() - expected.float()).abs()
        rel = (diff / expected.float().abs().clamp_min(atol)).max().item()
        raise VerificationError(f"{what} differs: max abs error {diff.max().item():.3g}, max rel error "
                                f"{rel:.3g} (rtol {rtol:g}, atol {atol:g}). If the pass changes rounding on "
                                "purpose, return PassResult(tolerance=(rtol, atol)) with the reason.")
