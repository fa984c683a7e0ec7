"""The planner against published figures: each setup's layout predicted by `picofx plan`'s model,
beside what its authors measured.

    python tools/plan_published.py [--json FILE]

Setups (the figure and where it is from):
  Picotron, Llama-2-7B, 64 H100: about 38% MFU (its README, self-reported; SEEDS.md)
  Picotron, SmolLM-1.7B, 8 H100: nearly 50% MFU (the same)
  torchtitan, Llama 3.1 8B, 8 H100, FSDP + torch.compile, local batch 2, sequence 8192, selective
    checkpointing: 6,667 tokens/s per GPU (docs/performance.md, Table 1; H100 at 500 W, 96 GB)
  torchtitan, Llama 3 8B, 64 A100, FSDP2, local batch 1, sequence 8192, selective op checkpointing:
    2,973 tokens/s per GPU, 58.2% MFU (docs/performance.md)
  torchtitan, Llama 3 70B, 64 A100, FSDP2, local batch 1, sequence 8192, full checkpointing:
    331 tokens/s per GPU, 51.7% MFU (the same)
Where the authors' layout is not given (Picotron), the planner's best plan stands in. MFU counts
matmul parameters (6N + 12 L h T per token); the error is predicted / published - 1 of the tokens/s
per GPU (from the MFU where only that is published).
"""
from __future__ import annotations

import argparse

import torch

from picofx.cost.device import A100, H100
from picofx.cost.model import CostModel
from picofx.planner.costs import model_costs
from picofx.planner.layouts import Layout, Run, plan_layouts, predict
from picofx.planner.models import model_config
from results import write_json  # tools/results.py

# name, model, device, gpus, seq, global batch, layout (None: the planner's best), published tokens/s/GPU, MFU
SETUPS = [
    ("Picotron Llama-2-7B, 64 H100", "llama2-7b", H100, 64, 4096, 256, None, None, 0.38),
    ("Picotron SmolLM-1.7B, 8 H100", "smollm-1.7b", H100, 8, 2048, 256, None, None, 0.50),
    ("torchtitan Llama 3.1 8B, 8 H100, FSDP + compile", "llama3-8b", H100, 8, 8192, 16,
     Layout(8, 1, 1, shard=True, microbatches=1, checkpoint=True), 6667, None),
    ("torchtitan Llama 3 8B, 64 A100, FSDP2", "llama3-8b", A100, 64, 8192, 64,
     Layout(64, 1, 1, shard=True, microbatches=1, checkpoint=True), 2973, 0.582),
    ("torchtitan Llama 3 70B, 64 A100, FSDP2", "llama3-70b", A100, 64, 8192, 64,
     Layout(64, 1, 1, shard=True, microbatches=1, checkpoint=True), 331, 0.517),
]


def rows() -> list[dict]:
    out, costs = [], {}
    for name, model, device, gpus, seq, batch, layout, tps, mfu in SETUPS:
        key = (model, device.name, seq)
        if key not in costs:
            costs[key] = model_costs(model_config(model), seq, CostModel(device))
        run = Run(costs[key], device, gpus, 8, batch)
        p = predict(run, layout) if layout else plan_layouts(run)[0]
        per_gpu = p.tokens_per_s / gpus
        published = tps if tps is not None else mfu * device.flops_per_second(torch.bfloat16) / costs[key].flops_per_token
        out.append({"setup": name, "layout": p.layout.describe(), "predicted_tokens_per_s_per_gpu": per_gpu,
                    "published_tokens_per_s_per_gpu": published, "predicted_mfu": p.mfu, "published_mfu": mfu,
                    "error": per_gpu / published - 1, "fits": p.fits})
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    args = p.parse_args(argv)
    table = rows()
    print(f"{'setup':48s} {'layout':32s} {'predicted':>10} {'published':>10} {'error':>7} {'MFU pred':>9} {'MFU pub':>8}")
    for r in table:
        published_mfu = f"{r['published_mfu']:.1%}" if r["published_mfu"] else "-"
        print(f"{r['setup']:48s} {r['layout']:32s} {r['predicted_tokens_per_s_per_gpu']:10,.0f} "
              f"{r['published_tokens_per_s_per_gpu']:10,.0f} {r['error']:+7.0%} {r['predicted_mfu']:9.1%} {published_mfu:>8}")
    write_json(table, args.json, "plan_published.json")
    return table


if __name__ == "__main__":
    main()
