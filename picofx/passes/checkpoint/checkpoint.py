"""Pass `checkpoint`: recompute forward values in backward so the step's peak fits a budget.

Joint stage. It tags forward nodes with torch's `recompute` policy (MUST_RECOMPUTE);
`picofx.partition.partition` then saves exactly the untagged forward values the backward reads
and recomputes the tagged ones in backward, just before their first use.

Under Inductor, every plan starts from what Inductor's own min-cut partition recomputes (the
base: cheap ops it fuses into backward kernels, priced as free; `picofx.partition.inductor_recomputes`
leaves out what it would recompute from a value the caller receives); without a budget to meet,
the pass tags that base alone, so the step runs as Inductor would partition it.

Algorithm:
1. Segments and options (`picofx.passes.checkpoint.recompute`): per decoder layer (and the code before/after the
   layers), the vertices of the lower convex hull of (saved bytes, recompute seconds), by
   parametric min-cut; each is a recompute set of least time for its saved bytes.
2. A peak model separable over the chain: while segment i runs (its forward, or its backward
   with its recomputation), live memory = (bytes saved by segments before it) + L_i, where L_i
   depends on segment i's own option. S_i(k) and L_i(k) are read off K exact simulations that
   put every segment on option k (K = options per layer, about 10).
3. Dynamic programming over the chain: state = bytes saved so far (in 2048 bins, rounded up),
   cost = recompute seconds; it finds the cheapest option per segment with
   saved-before-i + L_i <= budget for every i. Exact for the separable model, in
   O(segments x options x bins).
4. Exact check: the chosen tags are simulated (`predict_partition` mirrors the partition; liveness
   over both graphs). If the peak overshoots (the model ignores interactions between neighbours),
   the DP's budget is lowered by the overshoot and it runs again.
When the DP finds nothing that fits, it looks for the smallest peak: the DP at the least cap it
can meet, then steepest descent on the exact peak from the best plans seen and from the most
recompute everywhere, moving one group of identical layers at a time (`Planner.descend`,
at most 100 simulations from each start); the cheapest plan simulated that fits is taken.
If none fits, BudgetError states that smallest peak and the batch that would fit it.
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from picofx.cost.model import CostModel, StepMemory, is_alias, optimizer_state_bytes, resident_keys
from picofx.cost.liveness import NodeFacts
from picofx.cost.partition import IN_FORWARD, forward_region, inductor_recomputes, num_forward_outputs, predict_partition
from picofx.manager import Context, PassInfo, PassResult, Stage, register_pass
from picofx.errors import BudgetError
from picofx.runtime.heap import heap_frozen
from picofx.cost.units import check_budget, format_bytes, parse_budget
from picofx.capture.vocabulary import traced_module_path
from picofx.passes.checkpoint.float8_weights import float8_weight_notes, offer_float8_weight_casts
from picofx.passes.checkpoint.recompute import Segment, analyze, signature

MARK = "picofx_checkpoint"
BINS = 2048


@dataclass
class Prediction:
    levels: tuple
    recompute: frozenset  # nodes
    memory: StepMemory
    saved: list  # bytes saved per segment
    local: list  # L_i per segment
    forward_outputs: list  # the loss and the saved values
    backward_steps: list


class Planner:
    def __init__(self, joint: fx.GraphModule, cost_model: CostModel, optimizer_state: int):
        self.joint, self.cost_model, self.optimizer_state = joint, cost_model, optimizer_state
        self.num_fwd_outputs = num_forward_outputs(joint)
        self.forward = forward_region(joint)
        # Under Inductor every plan starts from what its own partition recomputes: those ops run
        # fused into backward kernels, so they count as free.
        self.base = inductor_recomputes(joint, self.num_fwd_outputs) if cost_model.fuses_pointwise else frozenset()
        self.base = frozenset(n for n in self.base if not n.meta.get(IN_FORWARD))  # priced, not free: module doc
        self.segments: list[Segment] = analyze(joint, lambda n: 0.0 if n in self.base else cost_model.node_time(n))
        self.segment_of = {n: i for i, seg in enumerate(self.segments) for n in seg.nodes}
        groups: dict[tuple, list[int]] = {}
        for i, seg in enumerate(self.segments):
            groups.setdefault(signature(seg), []).append(i)
        self.groups = list(groups.values())
        self.by_name = {n.name: n for n in joint.graph.nodes}
        self.cache: dict[tuple, Prediction] = {}
        self.facts = NodeFacts()  # each node's storages, asked again by every simulation

    def recompute_set(self, levels: tuple) -> frozenset:
        names = frozenset().union(*(seg.options[k].recompute for seg, k in zip(self.segments, levels)))
        return self.base | frozenset(self.by_name[n] for n in names)

    def predict(self, levels: tuple) -> Prediction:
        """The step's memory with each segment on its option `levels[i]` (() = the base alone),
        and the separable model's terms read off it."""
        if levels in self.cache:
            return self.cache[levels]
        recompute = self.recompute_set(levels)
        fw, bw = predict_partition(self.joint, recompute, self.num_fwd_outputs, self.forward)
        saved = self._saved_per_segment(fw)
        timelines = self.cost_model.timelines(fw, bw, self.facts)
        prediction = Prediction(levels, recompute,
                                self.cost_model.step_memory(fw, bw, self.optimizer_state, timelines, self.facts),
                                saved, self._local_terms(timelines, saved), fw.outputs, bw.steps)
        self.cache[levels] = prediction
        return prediction

    def _saved_per_segment(self, fw) -> list[int]:
        """Bytes of the storages the forward returns, by the segment of the node that allocated them."""
        allocator, resident = {}, resident_keys(fw, self.facts)
        for node in fw.steps:
            for key, nbytes, _ in self.facts.storages(node):
                if key not in resident:
                    allocator.setdefault(key, (node, nbytes))
        returned = {key for out in fw.outputs if out is not None for key, _, _ in self.facts.storages(out)}
        saved = [0] * len(self.segments)
        for key, (node, nbytes) in allocator.items():
            if key in returned and node in self.segment_of:
                saved[self.segment_of[node]] += nbytes
        return saved

    def _local_terms(self, timelines, saved: list[int]) -> list[float]:
        """L_i: the most live at a moment of segment i (its forward nodes; backward nodes reading
        its values, or following such), less what the segments before it saved."""
        before = np.concatenate([[0], np.cumsum(saved)[:-1]])
        local = [-math.inf] * len(self.segments)
        region = len(self.segments) - 1  # the backward starts with the last segment's gradients
        fw_t, bw_t = timelines
        for line, is_forward in ((fw_t, True), (bw_t, False)):
            for node, live in zip(line.nodes, line.live):
                if node in self.segment_of:
                    region = self.segment_of[node]
                elif is_forward:
                    continue
                else:
                    region = max((self.segment_of[a] for a in node.all_input_nodes if a in self.segment_of),
                                 default=region)
                local[region] = max(local[region], live - int(before[region]))
        return local

    def descend(self, start: Prediction, limit: int = 100) -> Prediction:
        """Lower the exact peak from `start` by steepest descent: each round moves the one group
        of identical segments (or a segment of its own) to the option that lowers the peak most;
        at most `limit` simulations. The DP's separable model misses plans whose peak depends on
        how neighbouring segments interact (fused kernels under Inductor), which this finds."""
        best, stop = start, len(self.cache) + limit
        while best.levels and len(self.cache) < stop:
            moves = [tuple(k if i in group else level for i, level in enumerate(best.levels))
                     for group in self.groups for k in range(len(self.segments[group[0]].options))]
            trial = min((self.predict(levels) for levels in moves), key=lambda p: p.memory.peak)
            if trial.memory.peak >= best.memory.peak:
                break
            best = trial
        return best

    def seconds(self, levels: tuple) -> float:
        return sum(seg.options[k].seconds for seg, k in zip(self.segments, levels))

    def cheapest_within(self, budget: int) -> Prediction | None:
        """Of the option sets simulated so far, the one of least recompute time that fits."""
        fitting = [p for p in self.cache.values() if p.levels and p.memory.peak <= budget]
        return min(fitting, key=lambda p: self.seconds(p.levels), default=None)

    def uniform(self, k: int) -> tuple:
        return tuple(min(k, len(seg.options) - 1) for seg in self.segments)

    def solve(self, cap: int, models: list[Prediction]) -> tuple | None:
        """Cheapest levels with saved-before-i + L_i(level_i) <= cap for every segment i, or None."""
        unit = max(cap, 1) / BINS
        cost = np.full(BINS + 1, np.inf)
        cost[0] = 0.0
        back = []
        for i, seg in enumerate(self.segments):
            new, choice, parent = np.full(BINS + 1, np.inf), np.full(BINS + 1, -1), np.full(BINS + 1, -1)
            for k in range(len(seg.options)):
                model = models[min(k, len(models) - 1)]
                room = cap - model.local[i]
                if room < 0:
                    continue
                size = math.ceil(model.saved[i] / unit)
                top = min(int(room // unit), BINS - size)
                if top < 0:
                    continue
                states = np.arange(top + 1)
                value = cost[states] + seg.options[k].seconds
                better = value < new[states + size]
                new[states[better] + size] = value[better]
                choice[states[better] + size], parent[states[better] + size] = k, states[better]
            cost = new
            back.append((choice, parent))
        if not np.isfinite(cost).any():
            return None
        state, levels = int(np.argmin(cost)), []
        for choice, parent in reversed(back):
            levels.append(int(choice[state]))
            state = int(parent[state])
        return tuple(reversed(levels))


def _clear_own_tags(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.meta.pop(MARK, False):
            node.meta.pop("recompute", None)


def _batch_size(joint: fx.GraphModule) -> int | None:
    """The leading dimension of the step's first integer input (token ids), if any; a complex
    buffer (a RoPE table) is neither floating point nor the batch."""
    for node in joint.graph.nodes:
        val = node.meta.get("val")
        if (node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim()
                and not (val.is_floating_point() or val.is_complex() or val.dtype == torch.bool)):
            return int(val.shape[0])
    return None


@register_pass("checkpoint")
@dataclass(frozen=True)
class Checkpoint:
    """budget: bytes (int), "8GiB"/"512MiB"/"1.5GB", or a fraction (float) of the predicted peak
    without checkpointing; None: the device's memory capacity. It covers the whole step:
    parameters, buffers, inputs, gradients, optimizer state (when `optimizer` names one:
    "adamw", or an optimizer instance), saved activations and transients.
    measure: after compiling, run one real step and measure its peak (`picofx.runtime.measure`);
    if it exceeds the budget, plan again for a peak below that plan's predicted one by the measured
    excess (at most twice).
    The notes' "rounds" list the predicted and measured peak of each plan. `measured_rounds`:
    (predicted, measured) of the plans before this one, which re-planning fills in."""

    budget: int | str | float | None = None
    optimizer: object = None
    measure: bool = False
    measured_rounds: tuple = ()

    @property
    def info(self) -> PassInfo:  # its peak is predicted for picofx's partition, used even when it tags nothing
        return PassInfo(Stage.JOINT, plans_partition=True, measures=self.measure, replans=self.measure, tags_only=True)

    def __post_init__(self):
        if self.budget is not None:
            check_budget(self.budget)  # a bad budget fails here, before the model is captured

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        with heap_frozen():  # the simulations allocate millions of small objects
            return self._plan(gm, ctx)

    def _plan(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        _clear_own_tags(gm)
        offer_float8_weight_casts(gm)
        cost_model = ctx.cost_model or CostModel(ctx.device)
        params = list(ctx.model.parameters()) if ctx.model is not None else []
        planner = Planner(gm, cost_model, optimizer_state_bytes(self.optimizer, params))
        before = planner.predict(())
        budget = (cost_model.device.memory_capacity if self.budget is None
                  else parse_budget(self.budget, reference=before.memory.peak))
        notes = {"budget": budget, "peak_before": before.memory.peak}
        # each plan measured over the budget: the next one is predicted below it by that excess
        target = min([budget, *(predicted - (measured - budget) for predicted, measured in self.measured_rounds)])
        if target < budget:
            notes["planned_for"] = target
        if before.memory.peak <= target:
            chosen = before
            notes["nothing_recomputed"] = (f"the no-checkpoint peak {format_bytes(before.memory.peak)} is already "
                                           f"under the budget {format_bytes(target)}; lower the budget to recompute")
        else:
            models = [planner.predict(planner.uniform(k)) for k in range(max(len(s.options) for s in planner.segments))]
            chosen = self._search(planner, models, target - before.memory.resident, target)
        if chosen is None:  # the DP's model missed; look at the least peaks it can reach, then give up
            smallest = self._smallest(planner, models, before.memory.peak - before.memory.resident)
            chosen = planner.cheapest_within(target)
            if chosen is None and target < budget:  # a re-plan that cannot make up the excess does its best
                chosen = min((p for p in planner.cache.values() if p.levels), key=lambda p: p.memory.peak,
                             default=None)
            if chosen is None:
                raise self._infeasible(smallest, before.memory, budget, _batch_size(gm))
        for node in chosen.recompute:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta[MARK] = True
        recomputed = [n for n in chosen.backward_steps if n in chosen.recompute and n not in planner.base]
        if self.measure:
            notes["rounds"] = [*({"predicted": p, "measured": m} for p, m in self.measured_rounds),
                               {"predicted": chosen.memory.peak}]
        return PassResult(bool(chosen.recompute), {
            **notes, "peak_after": chosen.memory.peak,
            "bytes_saved": before.memory.saved_activations - chosen.memory.saved_activations,
            "added_flops": sum(n.meta.get("flops", 0) or 0 for n in recomputed),
            "added_seconds": sum(cost_model.node_time(n) for n in recomputed),
            "recomputed": len(recomputed), "recomputed_as_inductor_does": len(planner.base),
            "simulations": len(planner.cache),
            "memory": dataclasses.asdict(chosen.memory), "per_layer": per_layer(chosen, planner),
            **float8_weight_notes(gm, chosen.forward_outputs, chosen.recompute)})

    def after_measured_step(self, record, measured: int) -> Checkpoint | None:
        """With `measure`: the peak of a real step under this plan (without the optimizer, whose
        predicted state is added) goes into the record; the pass to plan again with, if it is
        over the budget."""
        notes = record.notes
        peak = measured + notes["memory"]["optimizer_state"]
        notes["rounds"][-1]["measured"] = notes["measured_peak"] = peak
        if peak <= notes["budget"]:
            return None
        return dataclasses.replace(self, measured_rounds=(*self.measured_rounds, (notes["peak_after"], peak)))

    @staticmethod
    def _search(planner: Planner, models: list, cap: int, budget: int) -> Prediction | None:
        """DP at `cap`, checked exactly; lower the DP's cap by each overshoot (at most 8 tries).
        Falls back to the cheapest option set simulated so far that fits."""
        for _ in range(8):
            levels = planner.solve(cap, models)
            if levels is None:
                break
            prediction = planner.predict(levels)
            if prediction.memory.peak <= budget:
                return prediction
            cap -= prediction.memory.peak - budget + 1
        return planner.cheapest_within(budget)

    @staticmethod
    def _smallest(planner: Planner, models: list, cap: int) -> StepMemory:
        low, high = 0, cap  # smallest cap the DP can meet, by bisection, then what it really gives
        while high - low > max(cap // BINS, 1):
            mid = (low + high) // 2
            low, high = (low, mid) if planner.solve(mid, models) is not None else (mid, high)
        levels = planner.solve(high, models)
        if levels is not None:
            planner.predict(levels)
        starts = sorted((p for p in planner.cache.values() if p.levels), key=lambda p: p.memory.peak)[:2]
        starts.append(models[-1])  # the most recompute everywhere
        return min([planner.predict(()).memory, *(planner.descend(p).memory for p in starts)], key=lambda m: m.peak)

    @staticmethod
    def _infeasible(smallest: StepMemory, before: StepMemory, budget: int, batch: int | None) -> BudgetError:
        shown, least = format_bytes(budget), format_bytes(smallest.peak)
        if shown == least:  # too close to tell apart at two decimals
            shown, least = f"{budget:,} bytes", f"{smallest.peak:,} bytes"
        text = (f"checkpoint: the budget {shown} is below the smallest peak this step reaches with "
                f"recomputation, {least} ({format_bytes(before.peak)} without checkpointing)")
        fits = None
        if batch:
            fixed = smallest.resident + (smallest.gradients if smallest.peak_phase == "backward" else 0)
            per_sample = (smallest.peak - fixed) / batch
            fits = max(int((budget - fixed) // per_sample), 0) if per_sample > 0 else 0
            text += f" at batch {batch}; "
            if fits >= 1:
                text += (f"about batch {fits} fits in {format_bytes(budget)} (assuming activations scale "
                         "linearly with the batch; picofx.planner.predict.max_batch computes it exactly)")
            elif fixed >= budget:
                text += (f"no batch fits: parameters, buffers, inputs, gradients and optimizer state alone "
                         f"take {format_bytes(fixed)}")
            else:
                text += f"not even batch 1 fits: it needs about {format_bytes(fixed + per_sample)}"
        return BudgetError(text + ".", smallest.peak, fits)


def per_layer(chosen: Prediction, planner: Planner) -> dict[str, dict[str, list[str]]]:
    """Per segment, the values the backward reads that are saved, and those it recomputes
    (views, which cost nothing, left out); each as `node (module path inside the segment)`."""
    recomputed = {n for n in chosen.backward_steps if n in chosen.recompute and not is_alias(n)}
    saved = set(chosen.forward_outputs)
    out: dict[str, dict[str, list[str]]] = {}
    for seg in planner.segments:
        entry = out.setdefault(seg.name, {"saved": [], "recomputed": []})
        for node in seg.nodes:
            kind = "saved" if node in saved else "recomputed" if node in recomputed else None
            if kind:
                path = traced_module_path(node)
                where = path[len(seg.name) + 1:] if path.startswith(seg.name) else path
                entry[kind].append(f"{node.name} ({where})" if where else node.name)
    return out
