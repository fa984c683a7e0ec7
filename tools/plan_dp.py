"""Plan: data-parallel training of Llama-2-7B and SmolLM-1.7B on 8 and 64 H100s, predicted.

    python tools/plan_dp.py [--json plan_dp.json]

Each model is built under `picofx.plan.fake_mode()` (no memory, no weights) and predicted by
`picofx.plan.predict` with passes fuse + precision (bf16 matmuls, fp32 gradients) on the H100
description (`picofx.cost.device.H100`: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, datasheet). Per
GPU one micro-batch per step: Llama-2-7B 1 x 4096 tokens, SmolLM-1.7B 4 x 2048 tokens.

Gradients all-reduce in a ring (`picofx.cost.comm.ring_all_reduce_seconds`): 8 GPUs over NVLink 4
(450 GB/s one way per GPU, H100 datasheet), 64 GPUs (8 nodes) bound by InfiniBand NDR (one 400 Gb/s
port per GPU: 50 GB/s); latency 3 us in a node, 10 us across (typical NCCL figures, not datasheet).
Rows: without overlap every bucket is all-reduced after the backward (all of it exposed); with
`Overlap(bucket="auto")` buckets are planned from the backward's predicted timeline
(`picofx.cost.comm.plan_buckets`) and only what runs past the backward's end is exposed ("bf16":
the same with `compress="bf16"`, half the bytes). Step = forward + backward + exposed
communication; the optimizer step is not counted.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from picofx import plan
from picofx.cost.comm import Gradient, link_for, no_overlap, plan_buckets
from picofx.cost.device import H100
from picofx.cost.model import CostModel
from picofx.cost.units import format_bytes
from picofx.examples.llama import CONFIGS, Llama, LlamaConfig, causal_lm_loss
from picofx.cost.gradients import gradients_in_order, ready_times
from results import write_json  # tools/results.py

# SmolLM-1.7B's shape (HuggingFaceTB/SmolLM-1.7B config.json); the reference Llama unties the head,
# which adds 100M parameters to the tied checkpoint's 1.71B.
SMOLLM_1_7B = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                          num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048)
MODELS = {"Llama-2-7B": (CONFIGS["llama2-7b"], 1, 4096), "SmolLM-1.7B": (SMOLLM_1_7B, 4, 2048)}
FIRST_BUCKET = 1 << 20  # 1 MiB, as torch's DDP fusion pass starts
DDP_BUCKET = 25 << 20  # DDP's default bucket_cap_mb


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    return p.parse_args(argv)


def backward_gradients(config: LlamaConfig, batch: int, seq: int, cost_model: CostModel):
    """The predicted step's compute time and its gradients in the order the backward makes them."""
    with plan.fake_mode():
        model = Llama(dataclasses.replace(config, max_position_embeddings=seq))
        ids = torch.zeros(batch, seq, dtype=torch.long)
    step = plan.predict(model, {"input_ids": ids, "labels": ids}, loss_fn=causal_lm_loss,
                        passes=["fuse", "precision"], cost_model=cost_model)
    names = [name for name, _ in model.named_parameters()]
    grads = gradients_in_order(step.backward, names)
    ready, backward_seconds = ready_times(step.backward, [g[1] for g in grads], cost_model)
    items = [Gradient(name, node.meta["val"].numel() * node.meta["val"].element_size(), t)
             for (_, node, name), t in zip(grads, ready)]
    return step.seconds, backward_seconds, items, sum(p.numel() for p in model.parameters())


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    cost_model = CostModel(H100)
    rows = []
    header = (f"{'model':12s} {'GPUs':>4s} {'link':24s} {'compute s':>9s} {'comm s':>7s} {'step no overlap':>15s} "
              f"{'step overlap':>12s} {'exposed':>8s} {'bf16':>6s} {'buckets':>7s}  first buckets")
    print(header)
    for model_name, (config, batch, seq) in MODELS.items():
        compute, backward, grads, params = backward_gradients(config, batch, seq, cost_model)
        for gpus in args.gpus:
            link = link_for(H100, gpus)
            overlapped = plan_buckets(grads, backward, gpus, link, FIRST_BUCKET)
            after = no_overlap(grads, backward, gpus, link, DDP_BUCKET)
            half = [dataclasses.replace(g, nbytes=g.nbytes // 2) for g in grads]  # compress="bf16"
            compressed = plan_buckets(half, backward, gpus, link, FIRST_BUCKET)
            row = {"model": model_name, "parameters": params, "tokens_per_gpu": batch * seq, "gpus": gpus,
                   "link": link.name, "compute_s": compute, "backward_s": backward,
                   "comm_s": overlapped.comm_seconds, "step_no_overlap_s": compute + max(after.exposed_seconds, 0),
                   "step_overlap_s": compute + max(overlapped.exposed_seconds, 0),
                   "exposed_no_overlap_s": max(after.exposed_seconds, 0),
                   "exposed_overlap_s": max(overlapped.exposed_seconds, 0),
                   "exposed_overlap_bf16_s": max(compressed.exposed_seconds, 0),
                   "buckets": [{"bytes": b.nbytes, "comm_s": b.seconds, "exposed_s": b.exposed}
                               for b in overlapped.buckets]}
            rows.append(row)
            first = ", ".join(format_bytes(b.nbytes) for b in overlapped.buckets[:3])
            print(f"{model_name:12s} {gpus:4d} {link.name:24s} {compute:9.3f} {row['comm_s']:7.3f} "
                  f"{row['step_no_overlap_s']:15.3f} {row['step_overlap_s']:12.3f} {row['exposed_overlap_s']:8.3f} "
                  f"{row['exposed_overlap_bf16_s']:6.3f} {len(overlapped.buckets):7d}  {first}, ...")
    write_json(rows, args.json, "plan_dp.json")
    return rows


if __name__ == "__main__":
    main()
