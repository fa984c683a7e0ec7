"""Fuse(choose=...): which patterns fuse, and how their fused ops lower, chosen by timing on the device.

A pattern (a rule) is choosable when every op its replacement inserts is a fused op with a
decomposition (rms_norm, add_rms_norm, silu_mul, gelu_mul, rope); the others (projections,
attention, the loss) always fuse. Its candidates, at the shapes the graph has at its matches:
  "kernel"      the fused op launched as picofx's Triton kernel (on CUDA, where every op it inserts has one),
  "decomposed"  the fused op decomposed, so Inductor fuses it with its neighbours,
  "unfused"     the pattern's own ops, compiled as torch.compile compiles them: the rule is not applied.
The rules are first applied to a copy of the graph to find the shapes (later rules match earlier
rules' fused ops); picofx.runtime.kernel_choice times, caches and broadcasts.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from picofx.kernels import inductor_decompositions as fused_op_decompositions
from picofx.kernels.lowering import has_triton_kernel, triton_lowering
from picofx.rewrite import Rule
from picofx.rewrite.rewriter import rewrite
from picofx.runtime.compile import inductor_decompositions
from picofx.runtime.kernel_choice import CANDIDATES, Choice, Timer, choose


def _inserted(before: set, graph: fx.Graph) -> list[fx.Node]:
    """The fused op nodes of `graph` that are not in `before`."""
    return [n for n in graph.nodes if n not in before and n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "picofx"]


def _signature(match) -> tuple:
    """What a timing depends on: the variant, each tensor's shape, strides and dtype, each constant."""
    parts = [("variant", match.pattern.variant)]
    for name in sorted(match.bindings):
        value = match.val(name)
        if isinstance(value, torch.Tensor):
            parts.append((name, tuple(value.shape), tuple(value.stride()), str(value.dtype)))
        else:
            parts.append((name, value))
    return tuple(parts)


def _example_inputs(match, device: torch.device) -> dict:
    spec, _ = match.rule.variant_inputs(match.pattern.variant)
    kwargs = {}
    for name, kind in spec.items():
        value = match.val(name) if name in match.bindings else kind
        if isinstance(value, torch.Tensor):
            real = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
            if value.dtype.is_floating_point:
                real = real.normal_().requires_grad_()
            kwargs[name] = real
        else:
            kwargs[name] = value
    return kwargs


def _compiled_step(fn: Callable, make_kwargs: Callable[[], dict], lowered: tuple[str, ...], device: torch.device):
    """One forward and backward of fn(**make_kwargs()), made and compiled by Inductor on the first call
    (a cache hit allocates and compiles nothing); `lowered`: the fused ops launched as Triton kernels,
    the others decomposed (a pattern may hold another rule's fused op, as add_rms_norm holds rms_norm)."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    state: dict = {}

    def run():
        if "compiled" not in state:
            kwargs = make_kwargs()
            names = [n for n, v in kwargs.items() if isinstance(v, torch.Tensor)]

            def tensor_fn(*tensors):
                out = fn(**{**kwargs, **dict(zip(names, tensors))})
                return [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]

            state["inputs"] = [kwargs[n] for n in names]
            gm = make_fx(tensor_fn, tracing_mode="fake")(*state["inputs"])
            # AOT's cache keys the graph, not how its fused ops lower: it would serve one candidate's code to another.
            with triton_lowering(lowered), torch._functorch.config.patch(enable_autograd_cache=False):
                state["compiled"] = compile_fx(gm, state["inputs"], decompositions=inductor_decompositions(device))
        outputs = [o for o in state["compiled"](*state["inputs"]) if o.requires_grad]
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    return run


def choose_patterns(gm: fx.GraphModule, rules: list[Rule], device: torch.device, directory: str | None,
                    timer: Timer | None) -> tuple[dict[str, Choice], set[str]]:
    """(rule name -> its Choice for the choosable rules that match in `gm`, the names of the rules that
    match at all). A rule that matched nothing with every rule applied would only find what a pattern
    chosen "unfused" left (gated_activation the silu * up that swiglu left): it is not applied either.
    `gm` is left as it is."""
    trial_graph = fx.Graph()
    output = trial_graph.graph_copy(gm.graph, {})
    trial_graph.output(output)
    trial = fx.GraphModule(gm, trial_graph)
    # The loss always fuses: its point is never holding the logits, whatever its speed.
    decomposable = {op.name() for op in fused_op_decompositions()} - {"picofx::linear_cross_entropy"}
    patterns, shapes, matched = {}, {}, set()
    for rule in rules:
        before = set(trial.graph.nodes)
        applied, _, _ = rewrite(trial, rule)
        matched |= {rule.name} if applied else set()
        inserted = {n.target.name() for n in _inserted(before, trial.graph)}
        if not applied or not inserted or not inserted <= decomposable:
            continue
        counts = Counter(_signature(m) for m in applied)
        first = {}
        for m in applied:
            first.setdefault(_signature(m), m)
        kinds = {"decomposed": (), "unfused": ()}
        if device.type == "cuda" and all(has_triton_kernel(op) for op in inserted):
            kinds = {"kernel": tuple(sorted(inserted)), **kinds}
        patterns[rule.name] = {kind: _weighted([(counts[s], _step_for(m, kind, lowered, device))
                                                for s, m in first.items()])
                               for kind, lowered in kinds.items()}
        shapes[rule.name] = [[repr(s), counts[s]] for s in first]
    if not patterns:
        return {}, matched
    return choose(patterns, shapes, device=device, directory=directory, timer=timer), matched


def _step_for(match, kind: str, lowered, device):
    fn = match.rule.pattern if kind == "unfused" else (lambda **kw: match.rule.replacement(**kw, **match.rule.options))
    return _compiled_step(fn, lambda: _example_inputs(match, device), lowered, device)


def _weighted(steps: list[tuple[int, Callable[[], None]]]) -> Callable[[], None]:
    """One call runs each shape's step as many times as the graph has it."""
    def run():
        for count, step in steps:
            for _ in range(count):
                step()
    return run


def check_choices(choices, rules: list[Rule]) -> dict[str, str]:
    """A given choice per rule, checked: known rules, known candidates."""
    names = {rule.name for rule in rules}
    for name, chosen in choices.items():
        if name not in names:
            raise KeyError(f"Fuse(choose=...): no rule {name!r} among {', '.join(sorted(names))}")
        if chosen not in CANDIDATES:
            raise ValueError(f"Fuse(choose=...): rule {name!r} -> {chosen!r}; choose one of {', '.join(CANDIDATES)}")
    return dict(choices)


def mark_lowering(graph: fx.Graph, before: set, chosen: str) -> None:
    """Record on the fused op nodes a rule just inserted how Inductor lowers them
    (picofx.runtime.compile.triton_lowered_ops reads it; without a mark, the kernel where there is one)."""
    for node in _inserted(before, graph):
        node.meta["lowering"] = chosen
