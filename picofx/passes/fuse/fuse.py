"""Pass `fuse`: rewrite LLaMA blocks into fused kernels with pattern rules.

Each rule (picofx.rewrite.rules) is a pattern and a replacement traced to ATen plus checks; the built-in
ones fuse RMSNorm (alone and after the residual add), SwiGLU, the Q/K/V projections, RoPE
(rotate-half, complex, interleaved pairs), attention (to SDPA with grouped-query heads), and the
final projection with the cross-entropy loss. Users add rules with `picofx.rules.register_rule`.

Notes: matches per rule; `dropped_outputs` when the fused loss replaced logits that the graph
returned (they become None, e.g. `out.logits is None`; Fuse(keep_logits=True) keeps them);
`loss_chunks`: each fused loss's chunk count and why (picofx.passes.fuse.loss sizes them for the device);
with explain=True, `near_misses`: each rejected candidate, its rule, the check and the reason, and
`unfused_sites`: every site left that a rule could fuse (picofx.passes.fuse.sites: norms, gated
MLPs, RoPE, attention, loss) with why it was not: a rule's near-miss, a reason no rule may fuse
it (soft-capped attention; a loss with label smoothing, class or per-token weights), or "no
candidate" and what the code there looks like.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

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
from picofx.passes.fuse.sites import find_sites  # noqa: E402


# In bf16/fp16 a fused kernel rounds once (it computes in fp32 inside) where the unfused ops round
# every output: results an ulp or two apart (bf16's ulp is 2**-8 relative), more for values near 0.
LOW_PRECISION_TOLERANCE = (1e-2, 1e-3)


def _low_precision(match) -> bool:
    return any(isinstance(v, fx.Node) and getattr(v.meta.get("val"), "dtype", None) in (torch.bfloat16, torch.float16)
               for v in match.bindings.values())


@register_pass("fuse")
@dataclass(frozen=True)
class Fuse:
    rules: tuple | None = None  # rule names or Rule objects, applied in this order; None: all registered
    explain: bool = False       # also report near-misses (candidates a check rejected)
    keep_logits: bool = False   # the fused loss also returns the logits when the graph returns them
    # Precision's casts before the matmuls would hide SwiGLU, attention and the loss from the patterns.
    info = PassInfo(Stage.FORWARD, runs_before=("precision",))

    def selected_rules(self) -> list[Rule]:
        registered = registered_rules()
        if self.rules is None:
            return registered
        by_name = {rule.name: rule for rule in registered}
        unknown = [r for r in self.rules if isinstance(r, str) and r not in by_name]
        if unknown:
            raise KeyError(f"Fuse: unknown rules {unknown}; registered: {', '.join(by_name)}")
        return [by_name[r] if isinstance(r, str) else r for r in self.rules]

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
        for rule in rules:
            applied, missed, dropped_here = rewrite(gm, rule)
            notes[rule.name] = len(applied)
            near_misses += missed
            dropped += dropped_here
            if applied and rule.tolerance is not None:
                tolerances.append(rule.tolerance)
            if any(_low_precision(m) for m in applied):
                tolerances.append(LOW_PRECISION_TOLERANCE)
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
        return PassResult(changed=any(notes[rule.name] for rule in rules), notes=notes,
                          tolerance=tolerance)


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
