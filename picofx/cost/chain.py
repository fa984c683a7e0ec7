"""The step as a chain of units for pipeline cuts: where exactly one floating-point activation
crosses (the residual stream between and inside decoder layers), each unit's forward + backward
time, parameter and activation bytes. Read by the pipeline pass, its planner tool and the planner."""
from __future__ import annotations

import torch
from torch import fx

from picofx.capture.annotate import tensor_bytes
from picofx.capture.vocabulary import input_kind, layer_of, layer_of_path, module_path
from picofx.cost.balance import Unit
from picofx.cost.model import CostModel, is_alias

# AdamW training keeps 16 bytes per parameter: fp32 parameter, gradient and two moments; or, in
# mixed precision, bf16 parameter and gradient + fp32 master copy and two moments.
TRAINING_BYTES_PER_PARAMETER = 16


def state_per_parameter_byte(model) -> float:
    """Bytes a stage keeps per byte of its parameters while training with AdamW."""
    first = next(model.parameters(), None)
    return TRAINING_BYTES_PER_PARAMETER / (first.element_size() if first is not None else 4)


def chain_units(gm: fx.GraphModule, cost_model: CostModel, balance) -> tuple[list[Unit], list[int], list[fx.Node]]:
    """Units of the step's chain: (units, index in `main` where each begins, main nodes in order).
    Main nodes are those that depend on a user input; a unit ends where one floating-point value
    crosses, or where `balance` wants a stage to begin."""
    depends, needs_grad = set(), set()
    for node in gm.graph.nodes:
        if input_kind(node) == "user" or any(a in depends for a in node.all_input_nodes):
            depends.add(node)
        if input_kind(node) == "parameter" or any(a in needs_grad for a in node.all_input_nodes):
            needs_grad.add(node)
    main = [n for n in gm.graph.nodes if n.op == "call_function" and n in depends]
    position = {n: i for i, n in enumerate(main)}
    last_use = {n: max((position.get(u, len(main)) for u in n.users), default=i) for i, n in enumerate(main)}
    crossing = [0] * len(main)  # crossing[i]: floating-point values made at or before i, read after i
    for i, n in enumerate(main):
        if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point():
            for b in range(i, last_use[n]):
                crossing[b] += 1
    starts = [0] + [i + 1 for i in range(len(main) - 1) if crossing[i] == 1
                    and module_path(main[i + 1]) != module_path(main[i])]
    starts = sorted(set(starts) | set(wanted_starts(main, balance)))
    param_first_use: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if input_kind(node) == "parameter" and node.users:
            param_first_use[node] = min(position.get(_first_main_user(u, position), len(main) - 1) for u in node.users)
    units = []
    for k, lo in enumerate(starts):
        hi = starts[k + 1] if k + 1 < len(starts) else len(main)
        nodes = main[lo:hi]
        crossing_out = [n for n in main[:hi] if last_use[n] >= hi] if hi < len(main) else []
        units.append(Unit(label=module_path(nodes[0]) or nodes[0].name,
                          time=sum(cost_model.training_time(n, needs_grad) for n in nodes),
                          parameter_bytes=sum(tensor_bytes(p.meta["val"]) for p, u in param_first_use.items()
                                              if lo <= u < hi),
                          activation_bytes=sum(n.meta.get("bytes", 0) for n in nodes if not is_alias(n)),
                          boundary_bytes=sum(n.meta.get("bytes", 0) for n in crossing_out)))
    return units, starts, main


def _first_main_user(node: fx.Node, position: dict) -> fx.Node | None:
    """The first main node reached from `node` (a parameter's user may be a cast first)."""
    frontier = [node]
    while frontier:
        found = [n for n in frontier if n in position]
        if found:
            return min(found, key=position.__getitem__)
        frontier = [u for n in frontier for u in n.users]
    return None


def wanted_starts(main: list[fx.Node], balance) -> list[int]:
    """Where each layer begins ("layers"), or where each listed module path begins."""
    if balance == "cost":
        return []
    if balance == "layers":
        starts, seen = [], set()
        for i, n in enumerate(main):
            layer = layer_of(n)
            if layer is not None and layer not in seen:
                seen.add(layer)
                starts.append(i)
        return [s for s in starts if s > 0]
    starts = []
    for path in balance:
        hits = [i for i, n in enumerate(main) if module_path(n) == path
                or module_path(n).startswith(path + ".")]
        if not hits:
            raise ValueError(f"Pipeline: no computation comes from module {path!r}; name modules where stages "
                             "begin, e.g. 'decoder_layers.4'.")
        starts.append(hits[0])
    return starts


def layer_bounds(units: list[Unit], num_stages: int) -> list[int]:
    """Stage starts (unit indices) that give every stage an equal share of the repeated layers."""
    firsts, seen = [], set()
    for i, u in enumerate(units):
        layer = layer_of_path(u.label)
        if layer is not None and layer not in seen:
            seen.add(layer)
            firsts.append(i)
    if len(firsts) < num_stages:
        raise ValueError(f"Pipeline: balance='layers' needs at least {num_stages} repeated layers, the model has "
                         f"{len(firsts)}; use balance='cost' or fewer stages.")
    return [0] + [firsts[round(k * len(firsts) / num_stages)] for k in range(1, num_stages)]


def path_bounds(units: list[Unit], paths: list[str]) -> list[int]:
    bounds = [0]
    for path in paths:
        hits = [i for i, u in enumerate(units) if u.label == path or u.label.startswith(path + ".")]
        bounds.append(hits[0])
    if bounds != sorted(set(bounds)):
        raise ValueError(f"Pipeline: the module paths {paths} do not begin stages in graph order; list them as the "
                         "model runs them.")
    return bounds
