"""Plan: sharded data parallel (pass `shard`) of Llama-2-7B on 8 and 64 H100s, predicted, with the arithmetic.

    python tools/plan_shard.py [--gpus 8 64] [--json plan_shard.json]

The model is built under `picofx.planner.predict.fake_mode()` (no memory, no weights) and one rank's step
(1 x 4096 tokens, passes fuse + precision: bf16 matmuls) is predicted by `picofx.planner.predict.predict` on
the H100 description (`picofx.cost.device.H100`). Its forward and backward graphs give each
decoder layer's compute seconds (the embedding and the head are units of their own); each unit's
parameters are all-gathered in bf16 one layer ahead (prefetch 1), gathered again in the backward
(reshard_after_forward), and their gradients reduce-scattered in fp32 (`picofx.cost.shard`):
ring collectives over NVLink 4 in a node (450 GB/s one way per GPU), InfiniBand NDR across nodes
(50 GB/s per GPU), as `picofx plan --show buckets`. Replicated data parallel (DDP) is the row to compare:
16 bytes per parameter on every GPU.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from picofx.planner import predict as plan
from picofx.capture.vocabulary import layer_of_path, traced_module_path
from picofx.cost.comm import link_for
from picofx.cost.device import H100
from picofx.cost.model import CostModel
from picofx.cost.shard import ADAMW_STATE_BYTES, Layer, predict_sharded
from picofx.cost.units import format_bytes
from picofx.models.llama import CONFIGS, Llama, causal_lm_loss
from results import write_json  # tools/results.py

BATCH, SEQ = 1, 4096


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    return p.parse_args(argv)


def unit_of(path: str) -> str:
    """The sharding unit a module path belongs to: its decoder layer, else its top module."""
    return layer_of_path(path) or path.split(".")[0]


def layers_of(model, step, cost_model: CostModel) -> list[Layer]:
    """The units in forward order with their parameters and predicted forward and backward seconds."""
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        unit = unit_of(name.rpartition(".")[0])
        counts[unit] = counts.get(unit, 0) + p.numel()
    seconds = {unit: [0.0, 0.0] for unit in counts}
    last = list(counts)[-1]  # the loss and anything else outside a unit goes with the head
    for phase, graph in enumerate((step.forward, step.backward)):
        unit_at: dict = {}
        for node in graph.graph.nodes:
            path = traced_module_path(node)  # under the loss's wrapper: "model.decoder_layers.3..."
            unit = next((u for u in (unit_of(path), unit_of(path.partition(".")[2])) if u in seconds), None)
            # a node a pass made has no recorded module: it belongs where its inputs do
            unit_at[node] = unit or next((unit_at[a] for a in node.all_input_nodes if unit_at.get(a)), None)
            if node.op == "call_function":
                seconds[unit_at[node] or last][phase] += cost_model.node_time(node)
    return [Layer(unit, counts[unit], *seconds[unit]) for unit in counts]


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    cost_model = CostModel(H100)
    config = dataclasses.replace(CONFIGS["llama2-7b"], max_position_embeddings=SEQ)
    with plan.fake_mode():
        model = Llama(config)
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    step = plan.predict(model, {"input_ids": ids, "labels": ids}, loss_fn=causal_lm_loss, passes=["fuse", "precision"],
                        cost_model=cost_model)
    memory = step.memory
    activations = memory.other_resident + max(memory.forward_peak, memory.backward_peak - memory.gradients)
    layers = layers_of(model, step, cost_model)
    rows = []
    for gpus in args.gpus:
        link = link_for(H100, gpus)
        sharded = predict_sharded(layers, activations, gpus, link, gather_bytes_per_parameter=2)
        replicated = sum(layer.parameters for layer in layers) * ADAMW_STATE_BYTES + activations
        print(f"\nLlama-2-7B, {gpus} H100 ({link.name}), {BATCH} x {SEQ} tokens per GPU, shard + fuse + precision:")
        for line in sharded.arithmetic():
            print(f"  {line}")
        print(f"  replicated (DDP) for comparison: {format_bytes(replicated)} per GPU")
        rows.append({"gpus": gpus, "link": link.name, "memory_per_gpu": sharded.memory_per_rank,
                     "state_bytes": sharded.state_bytes, "activation_bytes": sharded.activation_bytes,
                     "gathered_bytes": sharded.gathered_bytes, "replicated_bytes": replicated,
                     "compute_s": sharded.compute_s, "step_s": sharded.step_s, "exposed_s": sharded.exposed_s,
                     "communication_s": sharded.communication_s, "arithmetic": sharded.arithmetic()})
    write_json(rows, args.json, "plan_shard.json")
    return rows


if __name__ == "__main__":
    main()
