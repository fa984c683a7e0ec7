"""Rewrite rules: a pattern and its replacement, plain functions traced to ATen, plus checks.

    def gelu_tanh_pattern(x):                      # what the model computes
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    def gelu_tanh_replacement(x):                  # what to compute instead: the same outputs
        return F.gelu(x, approximate="tanh")

    register_rule(Rule(
        name="gelu_tanh", pattern=gelu_tanh_pattern, replacement=gelu_tanh_replacement,
        inputs={"x": tensor(4, 8)},                # example inputs to trace with (any shape matches)
        tolerance=(1e-5, 1e-5), tolerance_reason="ATen's gelu evaluates the formula in another order",
    ))                                             # the fuse pass now applies it, after the built-in rules

Pattern and replacement take the same keyword arguments, described by `inputs`:
  tensor(*shape)  a tensor; in the graph it stands for any node.
  scalar(value)   a number the pattern uses as a constant (eps, ignore_index); in the graph it
                  stands for any number, and the replacement and the checks receive the one
                  matched. Traced with `value`: pick one no other constant of the pattern has.
  anything else   fixed: a bool, a string, a function, None (an absent bias); traced as it is.
Each variant overrides some inputs and is traced on its own; its "dtype" is the dtype of the
tensors that do not name one (fp32 and bf16 trace differently: the casts vanish in fp32).
Both functions are traced as `picofx.capture` traces models (torch.export, then the same
decompositions), so the pattern has exactly the nodes capture produces from the same code.

A check takes the `Match` (see picofx.rewrite.matcher) and returns None to accept it, or the
reason it rejects it. The fuse pass applies the registered rules in registration order.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from picofx.rewrite.tracing import Traced, call_nodes, normalized_args, set_normalized_args, trace_all


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None      # None: the variant's dtype
    stored_as: tuple[int, ...] | None = None  # memory order of the dims, outermost first; None: contiguous

    def example(self, default_dtype: torch.dtype) -> torch.Tensor:
        dtype = self.dtype or default_dtype
        order = self.stored_as or tuple(range(len(self.shape)))
        stored = [self.shape[d] for d in order]
        value = torch.randn(stored, dtype=dtype) if dtype.is_floating_point else torch.zeros(stored, dtype=dtype)
        return value.permute(sorted(range(len(order)), key=order.__getitem__))


@dataclass(frozen=True)
class ScalarSpec:
    example: int | float
    optional: bool = False  # the graph may have None there (e.g. SDPA's scale)

    def accepts(self, value) -> bool:
        if value is None:
            return self.optional
        kinds = (int, float) if isinstance(self.example, float) else (int,)
        return isinstance(value, kinds) and not isinstance(value, bool)


def tensor(*shape: int, dtype: torch.dtype | None = None, stored_as: tuple[int, ...] | None = None) -> TensorSpec:
    """A tensor input of the pattern, traced with this shape (any shape matches). Some ops trace
    differently for other memory layouts (a matmul copies an operand it cannot view as 3-d):
    stored_as=(0, 2, 1, 3) traces a (B, H, T, D) tensor laid out as (B, T, H, D)."""
    return TensorSpec(tuple(shape), dtype, stored_as)


def scalar(example: int | float, optional: bool = False) -> ScalarSpec:
    """A number the pattern uses as a constant; in the graph it matches any number (or None when
    optional). The pattern is traced with `example`: pick a value that no other constant of the
    pattern has (1e-6 rather than 1.0), since every constant equal to it becomes this input."""
    if isinstance(example, bool) or not isinstance(example, (int, float)):
        raise TypeError(f"scalar({example!r}): a number; make bools and strings fixed inputs or variants")
    return ScalarSpec(example, optional)


class RuleError(ValueError):
    """A rule is malformed: its pattern or replacement cannot be traced as declared."""


@dataclass(frozen=True, eq=False)
class Rule:
    name: str
    pattern: Callable[..., Any]
    replacement: Callable[..., Any]
    inputs: Mapping[str, Any]
    variants: Sequence[Mapping[str, Any]] = ({},)
    checks: Sequence[Callable[..., str | None]] = ()
    # fp32 (rtol, atol) when the replacement rounds differently from the pattern; give the reason.
    tolerance: tuple[float, float] | None = None
    tolerance_reason: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)  # keyword arguments of the replacement only
    # What tracing this rule gave; it lives and dies with the rule (and the copies with_options makes).
    traces: Traces = field(default_factory=lambda: Traces(), init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.tolerance is not None and not self.tolerance_reason:
            raise RuleError(f"rule {self.name!r}: a tolerance needs its tolerance_reason")
        for variant in self.variants:
            unknown = set(variant) - set(self.inputs) - {"dtype"}
            if unknown:
                raise RuleError(f"rule {self.name!r}: variant {dict(variant)} sets {sorted(unknown)}, "
                                f"which are not among its inputs {sorted(self.inputs)}")

    def variant_inputs(self, index: int) -> tuple[dict[str, Any], torch.dtype]:
        variant = dict(self.variants[index])
        dtype = variant.pop("dtype", torch.float32)
        return {**self.inputs, **variant}, dtype

    def with_options(self, **options) -> Rule:
        """This rule with the given replacement options set (those it has; others are ignored)."""
        changed = {k: v for k, v in options.items() if k in self.options and self.options[k] != v}
        if not changed:
            return self
        copy = dataclasses.replace(self, options={**self.options, **changed})
        object.__setattr__(copy, "traces", self.traces)  # same pattern, inputs and variants: same traces
        return copy


# The registry: the fuse pass applies these in order. Order matters where one rule's replacement is
# another rule's pattern (add_rms_norm matches an add followed by the rms_norm op).
RULES: list[Rule] = []


def register_rule(rule: Rule, *, before: str | None = None) -> Rule:
    """Add `rule` to the registry, last or before the rule named `before`."""
    names = [r.name for r in RULES]
    if rule.name in names:
        raise ValueError(f"register_rule: a rule named {rule.name!r} is already registered")
    if before is not None and before not in names:
        raise KeyError(f"register_rule: no rule named {before!r}; registered: {', '.join(names)}")
    RULES.insert(names.index(before) if before is not None else len(RULES), rule)
    return rule


def unregister_rule(name: str) -> Rule:
    for i, rule in enumerate(RULES):
        if rule.name == name:
            return RULES.pop(i)
    raise KeyError(f"unregister_rule: no rule named {name!r}")


def registered_rules() -> list[Rule]:
    return list(RULES)


# ---- patterns ------------------------------------------------------------------------------

@dataclass
class Pattern:
    variant: int
    graph: fx.Graph
    inputs: dict[fx.Node, str]  # placeholder -> input name (tensors and scalars)


class Traces:
    """A rule's traces: its pattern graphs (one per distinct variant trace), and its pattern and
    replacement traced on candidates' inputs, keyed by those inputs' shapes, layouts, dtypes and
    matched constants (the same keys recur in every layer and every step). The most recent
    `LIMIT` of those are kept: a long run over many shapes does not grow without bound."""

    LIMIT = 512  # a model with a few dtypes and sequence lengths needs a few dozen per rule

    def __init__(self):
        self.patterns: list[Pattern] | None = None
        self.on_inputs: OrderedDict[tuple, Traced | Exception] = OrderedDict()

    def get(self, key: tuple) -> Traced | Exception | None:
        found = self.on_inputs.get(key)
        if found is not None:
            self.on_inputs.move_to_end(key)
        return found

    def put(self, key: tuple, traced: Traced | Exception) -> None:
        self.on_inputs[key] = traced
        self.on_inputs.move_to_end(key)
        while len(self.on_inputs) > self.LIMIT:
            self.on_inputs.popitem(last=False)


def pattern_graphs(rule: Rule) -> list[Pattern]:
    """The rule's pattern traced for each variant (identical traces once), scalars as placeholders."""
    if rule.traces.patterns is None:
        trace_patterns([rule])
    return rule.traces.patterns


def trace_patterns(rules: Sequence[Rule], store=None) -> None:
    """Trace the patterns of every rule not traced yet, all in one export; with a `store`
    (picofx.rewrite.pattern_store.PatternStore), take those it holds from it and keep the rest there."""
    rules = list({r.traces: r for r in rules if r.traces.patterns is None}.values())  # copies trace once
    if store is not None:
        for rule in rules:
            rule.traces.patterns = store.load(rule)
        traced_now = [rule for rule in rules if rule.traces.patterns is None]
        trace_patterns(traced_now)
        for rule in traced_now:
            store.save(rule, rule.traces.patterns)
        return
    calls, owners = [], []
    for rule in rules:
        for index in range(len(rule.variants)):
            kwargs, dtype = rule.variant_inputs(index)
            calls.append((rule.pattern, {k: v.example(dtype) if isinstance(v, TensorSpec)
                                         else v.example if isinstance(v, ScalarSpec) else v
                                         for k, v in kwargs.items()}))
            owners.append((rule, index))
    patterns = {rule.traces: [] for rule in rules}
    for (rule, index), traced in zip(owners, trace_all(calls)):
        if isinstance(traced, Exception):
            raise RuleError(f"rule {rule.name!r}: its pattern does not trace for variant {index} "
                            f"({dict(rule.variants[index])}): {type(traced).__name__}: {traced}") from traced
        for node in call_nodes(traced.graph):
            set_normalized_args(node, normalized_args(node))
        for name, spec in rule.variant_inputs(index)[0].items():
            if isinstance(spec, ScalarSpec):
                _make_placeholder(rule, traced, name, spec.example)
        traced.graph.eliminate_dead_code()
        mine = patterns[rule.traces]
        if all(str(p.graph) != str(traced.graph) for p in mine):
            mine.append(Pattern(index, traced.graph, traced.inputs))
    for rule in rules:  # only once every variant traced: a rule that raised stays untraced
        rule.traces.patterns = patterns[rule.traces]


def _make_placeholder(rule: Rule, traced: Traced, name: str, example: int | float) -> None:
    """Turn every constant equal to `example` into a placeholder named `name`. A constant that only
    happens to be equal is harmless: the same_math check compares it with the matched value."""
    with traced.graph.inserting_before(next(iter(traced.graph.nodes))):
        placeholder = traced.graph.placeholder(name)
    traced.inputs[placeholder] = name

    def swap(value):
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        same = type(value) is type(example) and value == example
        return placeholder if same else value

    found = False
    for node in call_nodes(traced.graph):
        values = normalized_args(node)
        swapped = [swap(v) for v in values]
        if swapped != values:
            set_normalized_args(node, swapped)
            found = True
    if not found:
        raise RuleError(f"rule {rule.name!r}: scalar input {name}={example!r} appears nowhere in the traced "
                        "pattern; it must be used as a constant of an op (not computed with)")
