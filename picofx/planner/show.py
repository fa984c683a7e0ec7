"""`picofx plan --show stages|buckets`: the whole model's graph under a plan, where the layer-level
prediction is not enough.

- stages: the best pipelined plan's model captured on the meta device (bf16, one micro-batch of the
  plan's size) and cut by pass `pipeline`'s own analysis, uniform layers against cost-balanced cuts
  (`picofx.cost.balance.balanced_cuts`, memory within the GPU), for GPipe, 1F1B and interleaved
  1F1B (the plan's stages per GPU, at least 2): step, bubble, slowest stage, peak memory of each GPU
  (16 bytes of training state per parameter, divided over the plan's tp and shard ranks; every value the
  forward computes counted as kept: an upper bound without checkpointing), where each stage begins.
- buckets: the best plan of replicated data parallel alone, its gradients (the whole model's) in
  the order the backward makes them (fake tensors; fuse + precision) bucketed by pass `overlap`'s
  own planner (`picofx.cost.comm.plan_buckets`) against DDP's all-reduce after the backward in 25 MiB buckets,
  and with bf16 compression: the exposed seconds of each, the bucket sizes.
"""
from __future__ import annotations

import dataclasses

import torch

from picofx.cost.comm import Gradient, no_overlap, plan_buckets
from picofx.cost.model import CostModel
from picofx.cost.units import format_bytes
from picofx.planner.layouts import Run

SCHEDULES = (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2))
FIRST_BUCKET = 1 << 20  # overlap's default first bucket (1 MiB)
DDP_BUCKET = 25 << 20  # DDP's bucket_cap_mb default


def micro_batch(run: Run, layout) -> int:
    return max(1, run.global_batch // (layout.dp * layout.microbatches))


def stage_rows(run: Run, layout) -> tuple[list[dict], str]:
    """Per schedule and cut: the pipeline of `layout` (its pp ranks, micro-batches and micro-batch size)."""
    from picofx.capture.export import capture
    from picofx.cost.balance import balanced_cuts, microbatch_refusal, plan_for
    from picofx.cost.chain import chain_units, layer_bounds, state_per_parameter_byte
    from picofx.models.llama import Llama, causal_lm_loss

    config, seq, b = run.costs.config, run.costs.seq, micro_batch(run, layout)
    with torch.device("meta"):
        model = Llama(dataclasses.replace(config, max_position_embeddings=max(seq, 8))).to(torch.bfloat16)
        ids = torch.zeros(b, seq, dtype=torch.long)
    gm = capture(model, {"input_ids": ids, "labels": ids}, causal_lm_loss)  # returns the loss alone
    units, _, _ = chain_units(gm, CostModel(run.device), "layers")
    capacity = run.device.memory_capacity
    split = layout.tp * (layout.dp if layout.shard else 1)  # the ranks a stage's training state is divided over
    common = dict(microbatches=layout.microbatches, link=run.link(run.gpus, run.gpus // layout.pp),
                  state_per_parameter_byte=state_per_parameter_byte(model) / split)
    rows = []
    for schedule, virtual in SCHEDULES:
        virtual = max(virtual, layout.virtual_stages) if virtual > 1 else 1  # interleaved: the plan's own count
        stages = layout.pp * virtual
        if stages > len(units) or microbatch_refusal(layout.pp, layout.microbatches, schedule):
            continue
        plans = {}
        if stages <= config.num_hidden_layers:
            plans["uniform layers"] = plan_for(units, layer_bounds(units, stages), schedule=schedule,
                                               virtual=virtual, capacity=capacity, **common)
        try:
            plans["cost-balanced"] = balanced_cuts(units, stages, schedule=schedule, virtual=virtual,
                                                   capacity=capacity, **common)
        except MemoryError:
            plans["cost-balanced (no fit)"] = balanced_cuts(units, stages, schedule=schedule, virtual=virtual, **common)
        for cuts, plan in plans.items():
            memory = [sum(s.memory for s in plan.stages if s.rank == r) for r in range(layout.pp)]
            rows.append({"schedule": schedule, "virtual": virtual, "cuts": cuts, "step_s": plan.step_time,
                         "bubble": plan.bubble, "slowest_stage_s": max(s.time for s in plan.stages),
                         "peak_bytes_per_gpu": memory, "fits": max(memory) <= capacity,
                         "stage_starts": [units[s.units.start].label for s in plan.stages]})
    head = (f"pipeline stages of {layout.describe()} ({b} x {seq} tokens per micro-batch, {len(units)} places to cut; "
            f"{run.device.name}, {capacity / 1e9:.0f} GB; training state over {split} ranks, activations whole)")
    return rows, head


def stages_table(rows: list[dict], head: str) -> str:
    header = f"{'schedule':16s} {'cuts':22s} {'step s':>8s} {'bubble':>7s} {'slowest ms':>10s}  peak per GPU"
    lines = [head, header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['schedule']:16s} {r['cuts']:22s} {r['step_s']:8.3f} {r['bubble']:7.1%} "
                     f"{r['slowest_stage_s'] * 1e3:10.1f}  "
                     + ", ".join(format_bytes(m) for m in r["peak_bytes_per_gpu"])
                     + ("" if r["fits"] else "  (does not fit)"))
        lines.append(f"{'':16s}   stages begin at: {', '.join(r['stage_starts'])}")
    return "\n".join(lines)


def bucket_rows(run: Run, layout, passes=("fuse", "precision")) -> tuple[dict, str]:
    """The gradient all-reduce of `layout`'s replicas (one micro-batch's backward), bucketed three ways."""
    from picofx.planner import predict as plan
    from picofx.cost.gradients import gradients_in_order, ready_times
    from picofx.models.llama import Llama, causal_lm_loss

    config, seq, b = run.costs.config, run.costs.seq, micro_batch(run, layout)
    cost_model = CostModel(run.device)
    with plan.fake_mode():
        model = Llama(dataclasses.replace(config, max_position_embeddings=max(seq, 8)))
        ids = torch.zeros(b, seq, dtype=torch.long)
    step = plan.predict(model, {"input_ids": ids, "labels": ids}, loss_fn=causal_lm_loss, passes=list(passes),
                        cost_model=cost_model)
    grads = gradients_in_order(step.backward, [name for name, _ in model.named_parameters()])
    ready, backward = ready_times(step.backward, [g[1] for g in grads], cost_model)
    items = [Gradient(name, node.meta["val"].numel() * node.meta["val"].element_size(), t)
             for (_, node, name), t in zip(grads, ready)]
    link = run.link(layout.dp * layout.tp, layout.tp)
    overlapped = plan_buckets(items, backward, layout.dp, link, FIRST_BUCKET)
    after = no_overlap(items, backward, layout.dp, link, DDP_BUCKET)
    half = plan_buckets([dataclasses.replace(g, nbytes=g.nbytes // 2) for g in items], backward, layout.dp, link,
                        FIRST_BUCKET)
    row = {"layout": layout.describe(), "tokens_per_micro_batch": b * seq, "link": link.name,
           "compute_s": step.seconds, "backward_s": backward, "comm_s": overlapped.comm_seconds,
           "exposed_after_backward_s": max(after.exposed_seconds, 0.0),
           "exposed_overlap_s": max(overlapped.exposed_seconds, 0.0),
           "exposed_overlap_bf16_s": max(half.exposed_seconds, 0.0),
           "buckets": [{"bytes": k.nbytes, "comm_s": k.seconds, "exposed_s": k.exposed} for k in overlapped.buckets]}
    text = (f"gradient buckets of {layout.describe()} ({b} x {seq} tokens per micro-batch, {layout.dp} replicas over "
            f"{link.name}): compute {row['compute_s'] * 1e3:.1f} ms, all-reduce {row['comm_s'] * 1e3:.1f} ms; exposed "
            f"after the backward (DDP, 25 MiB buckets) {row['exposed_after_backward_s'] * 1e3:.1f} ms, overlapped "
            f"{row['exposed_overlap_s'] * 1e3:.1f} ms, overlapped in bf16 "
            f"{row['exposed_overlap_bf16_s'] * 1e3:.1f} ms; "
            f"{len(overlapped.buckets)} buckets: "
            + ", ".join(format_bytes(k.nbytes) for k in overlapped.buckets[:6])
            + (", ..." if len(overlapped.buckets) > 6 else ""))
    return row, text


def show(what: str, run: Run, predictions: list, passes) -> tuple[object, str]:
    """The JSON and the text of `--show what` for the best plan it applies to (one that fits if any does)."""
    wanted = (lambda p: p.layout.pp > 1) if what == "stages" else (lambda p: p.layout.dp > 1 and not p.layout.shard
                                                                 and p.layout.tp == p.layout.pp == 1)
    candidates = [p for p in predictions if wanted(p)]
    chosen = next((p for p in candidates if p.fits), candidates[0] if candidates else None)
    if chosen is None:
        kind = "pipelined" if what == "stages" else "replicated data parallel of whole models"
        return None, f"{what}: no plan is {kind}"
    note = "" if chosen.fits else f" (it does not fit: {chosen.reason})"
    if what == "stages":
        rows, head = stage_rows(run, chosen.layout)
        return rows, stages_table(rows, head + note)
    row, text = bucket_rows(run, chosen.layout, passes)
    return row, text + note
