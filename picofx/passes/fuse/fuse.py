"""Pass `fuse`: rewrite LLaMA blocks into fused kernels with pattern rules.

Each rule (picofx.rewrite.rules) is a pattern and a replacement traced to ATen plus checks; the built-in
ones fuse RMSNorm (alone and after the residual add), SwiGLU, RoPE
(rotate-half, complex, interleaved pairs), attention (to SDPA with grouped-query heads), and the
final projection with the cross-entropy loss; then SDPA under a mask proven causal runs is_causal
without it (causal_attention, in picofx.passes.fuse.attention). Users add rules with
`picofx.rules.register_rule`.

Notes: matches per rule (and causal_attention's count); `dropped_outputs` when the fused loss replaced logits that the graph
returned (they become None, e.g. `out.logits is None`; Fuse(keep_logits=True) keeps them);
`loss_chunks`: each fused loss's chunk count and why (picofx.passes.fuse.loss sizes them for the device);
with explain=True, `near_misses`: each rejected candidate, its rule, the check and the reason, and
`unfused_sites`: every site left that a rule could fuse (picofx.passes.fuse.sites: norms, gated
MLPs, RoPE, attention, loss) with why it was not: a rule's near-miss, a reason no rule may fuse
it (soft-capped attention; a loss with label smoothing, class or per-token weights), or "no
candidate" and what the code there looks like. With choose="measure" (the default on CUDA),
`kernel_choice`: per pointwise pattern the candidate kept and each candidate's time (choose.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Mapping

import torch
from torch import fx

from picofx.runtime.heap import heap_frozen
from picofx.manager import Context, PassInfo, PassResult, Stage, register_pass
from picofx.rewrite.matcher import prepare
from picofx.rewrite.pattern_store import PatternStore
from picofx.rewrite.rewriter import rewrite
from picofx.rewrite import Rule, registered_rules

# Registration order is the order rules apply in: a rule whose pattern contains another rule's
# fused op comes after it (add_rms_norm after rms_norm; grouped-query SDPA after attention).
from picofx.passes.fuse import norms, projections, attention  # noqa: F401, E402  isort: skip
from picofx.passes.fuse import interleaved_rope, loss  # noqa: F401, E402  isort: skip
from picofx.passes.fuse.attention import CAUSAL_ATTENTION, causal_attention  # noqa: E402
from picofx.passes.fuse.sites import find_sites  # noqa: E402
from picofx.passes.fuse.choose import check_choices, choose_patterns, mark_lowering  # noqa: E402


# In bf16/fp16 a fused kernel rounds once (it computes in fp32 inside) where the unfused ops round
# every output: results an ulp or two apart (bf16's ulp is 2**-8 relative), more for values near 0.
LOW_PRECISION_TOLERANCE = (1e-2, 1e-3)


def _low_precision(match) -> bool:
    return any(isinstance(v, fx.Node) and getattr(v.meta.get("val"), "dtype", None) in (torch.bfloat16, torch.float16)
               for v in match.bindings.values())


@register_pass("fuse")
@dataclass(frozen=True)
class Fuse:
    # Rule names or Rule objects, applied in this order; None: all registered. "causal_attention" (SDPA
    # under a mask proven causal runs is_causal, fuse/attention.py) comes after them, when named or None.
    rules: tuple | None = None
    explain: bool = False       # also report near-misses (candidates a check rejected)
    keep_logits: bool = False   # the fused loss also returns the logits when the graph returns them
    # How the pointwise patterns run (picofx.passes.fuse.choose): "measure" times picofx's kernel, the
    # decomposition and the unfused ops on the device and keeps the fastest; "fixed" fuses them all
    # (Triton kernels on CUDA); a dict {rule: "kernel" | "decomposed" | "unfused"} says it. None:
    # "measure" on CUDA, "fixed" elsewhere.
    choose: str | Mapping[str, str] | None = None
    timer: Callable | None = None  # choose="measure": (pattern, candidate, run) -> seconds; None: the device's clock
    # Precision's casts before the matmuls would hide SwiGLU, attention and the loss from the patterns.
    info = PassInfo(Stage.FORWARD, runs_before=("precision",))

    def selected_rules(self) -> list[Rule]:
        registered = registered_rules()
        if self.rules is None:
            return registered
        by_name = {rule.name: rule for rule in registered}
        unknown = [r for r in self.rules if isinstance(r, str) and r not in (*by_name, CAUSAL_ATTENTION)]
        if unknown:
            raise KeyError(f"Fuse: unknown rules {unknown}; registered: {', '.join(by_name)}")
        return [by_name[r] if isinstance(r, str) else r for r in self.rules if r != CAUSAL_ATTENTION]

    def __post_init__(self):
        if isinstance(self.choose, Mapping):
            check_choices(self.choose, self.selected_rules())
        elif self.choose not in (None, "measure", "fixed"):
            raise ValueError(f"Fuse(choose={self.choose!r}): 'measure', 'fixed', or a dict rule -> "
                             "'kernel' | 'decomposed' | 'unfused'")

    def _lowering(self, gm: fx.GraphModule, ctx: Context, rules: list[Rule], notes: dict) -> dict[str, str]:
        """rule name -> "kernel", "decomposed" or "unfused"; rules not named keep the fixed lowering."""
        device = ctx.device if ctx else torch.device("cpu")
        # Measured only where it runs: not while a GPU run is predicted on a machine without one.
        on_gpu = device.type == "cuda" and torch.cuda.is_available()
        choose = self.choose or ("measure" if on_gpu else "fixed")
        if isinstance(choose, Mapping):
            return dict(choose)
        if choose == "fixed":
            return {}
        choices, matched = choose_patterns(gm, rules, device, ctx.cache_directory if ctx else None, self.timer)
        notes["kernel_choice"] = {name: choice.describe() for name, choice in choices.items()}
        return {**{rule.name: "unfused" for rule in rules if rule.name not in matched},
                **{name: choice.chosen for name, choice in choices.items()}}

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        with heap_frozen():  # matching and re-propagation allocate many small objects
            return self._fuse(gm, ctx)

    def _fuse(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        notes: dict = {}
        near_misses, dropped, tolerances = [], [], []
        chunking = loss.context_chunking(ctx)
        rules = [rule.with_options(keep_logits=self.keep_logits, chunking=chunking) for rule in self.selected_rules()]
        directory = ctx.cache_directory if ctx else None  # the optimized-graph cache's, when on
        prepare(gm.graph, rules, PatternStore(directory) if directory else None)
        lowering = self._lowering(gm, ctx, rules, notes)
        for rule in rules:
            if lowering.get(rule.name) == "unfused":
                notes[rule.name] = 0
                continue
            chosen = lowering.get(rule.name)
            before = set(gm.graph.nodes) if chosen else None  # only a chosen lowering marks the new nodes
            applied, missed, dropped_here = rewrite(gm, rule)
            if chosen:
                mark_lowering(gm.graph, before, chosen)
            notes[rule.name] = len(applied)
            near_misses += missed
            dropped += dropped_here
            if applied and rule.tolerance is not None:
                tolerances.append(rule.tolerance)
            if any(_low_precision(m) for m in applied):
                tolerances.append(LOW_PRECISION_TOLERANCE)
        if self.rules is None or CAUSAL_ATTENTION in self.rules:  # after the rules that make SDPA
            notes[CAUSAL_ATTENTION], missed = causal_attention(gm.graph)
            near_misses += missed
        gm.recompile()
        if notes.get(loss.LINEAR_CROSS_ENTROPY.name):
            notes["loss_chunks"] = loss.chunking_notes(gm.graph, chunking)
        if dropped:
            notes["dropped_outputs"] = (f"{', '.join(dropped)} -> None: the fused loss never makes the logits "
                                        "(Fuse(keep_logits=True) keeps them)")
        if self.explain:
            notes["near_misses"] = [asdict(m) for m in near_misses]
            notes["unfused_sites"] = unfused_sites(gm.graph, near_misses)
        tolerance = tuple(max(t[i] for t in tolerances) for i in range(2)) if tolerances else None
        changed = any(notes[rule.name] for rule in rules) or notes.get(CAUSAL_ATTENTION, 0) > 0
        return PassResult(changed=changed, notes=notes, tolerance=tolerance)


@register_pass("fuse_loss")
@dataclass(frozen=True)
class FuseLoss(Fuse):
    """Fuse with the loss rule alone (the final projection and the cross-entropy as one op): what
    tensor_parallel requires before it splits the LM head's vocabulary (PassInfo.requires), so that
    pass never runs fuse inside itself. After a pipeline cut, on each stage's graph."""

    rules: tuple | None = (loss.LINEAR_CROSS_ENTROPY.name,)
    info = PassInfo(Stage.FORWARD, runs_before=("precision",), runs_after=("pipeline",))


def unfused_sites(graph: fx.Graph, near_misses: list) -> list[str]:
    """One line per fusible site left in the graph: where it is, and why it did not fuse."""
    lines = []
    for site in find_sites(graph):
        where = f"{site.kind} at {site.node}" + (f" in {site.module_path}" if site.module_path else "")
        missed = [m for m in near_misses if site.module_path and m.candidate.endswith(f" in {site.module_path}")]
        if site.reason is not None:
            why = f"not fusible: {site.reason}"
        elif missed:
            why = "; ".join(f"rule {m.rule} rejected it ({m.check}): {m.reason}" for m in missed)
        else:
            why = f"no candidate: {site.looks_like}, and no rule matches it"
        lines.append(f"{where}: {why}")
    return lines
