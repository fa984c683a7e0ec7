"""The planner against published training runs: each run's own layout predicted by `picofx plan`'s
model on the GPU profile it ran on, beside what its authors measured, tokens/s and memory per GPU.

    python tools/plan_published.py [--json FILE] [--write-docs] [--fit]

--write-docs rewrites the table in docs/PLANNER_ACCURACY.md; --fit searches the profiles' fitted
figures (picofx.cost.gpus.FITTED) on the runs marked `fit`, and prints them: the other runs check
them. The runs, their layouts and their sources are in published_runs.py beside this file.
"""
from __future__ import annotations

import argparse
import dataclasses
import pickle
import re
from pathlib import Path

import torch

from picofx.cost import gpus
from picofx.cost.model import CostModel
from picofx.planner import costs as planner_costs
from picofx.planner.costs import ModelCosts, model_costs
from picofx.planner.float8 import at_precision
from picofx.planner.layouts import MAX_MEMORY_FRACTION, Run, predict
from picofx.planner.models import model_config
from published_runs import NOT_EXPRESSIBLE, RUNS, Published  # tools/published_runs.py
from results import write_json  # tools/results.py

DOCS = Path(__file__).resolve().parents[1] / "docs" / "PLANNER_ACCURACY.md"
BEGIN, END = "<!-- published table: begin -->", "<!-- published table: end -->"
GiB = 2**30


def passes(run: Published) -> tuple:
    return ("fuse", "precision") if run.compiled else ("precision",)


def weights_kept_in_bf16(costs: ModelCosts) -> ModelCosts:
    """Megatron keeps the model's weights in half precision (the fp32 master copy is the optimizer's)
    and FSDP2 casts each shard once before gathering it: no run casts its weights per call, as
    picofx's precision pass does."""
    return dataclasses.replace(costs, layer_call_forward_s=0.0, layer_call_backward_s=0.0, rest_call_forward_s=0.0,
                               rest_call_backward_s=0.0)


def every_second_matmul(costs: ModelCosts) -> ModelCosts:
    """torchtitan's op-level selective checkpointing: of a layer's matmuls (q, k, v, o, gate, up,
    down) the 1st, 3rd, 5th and 7th outputs are kept (q, v, gate, down) with attention's output and
    the layer's input; k, o and up are recomputed with the memory-bound kernels."""
    c = costs.config
    h, kv, mlp = c.hidden_size, c.num_key_value_heads * c.head_dim, c.intermediate_size
    share = (h * kv + h * h + h * mlp) / (h * (2 * h + 2 * kv) + 3 * h * mlp)
    recomputed = share * costs.layer_matmul_forward_s
    kept = costs.seq * (2 * (4 * h + kv + mlp) + 4 * c.num_attention_heads)  # bf16, and attention's fp32 logsumexp
    return dataclasses.replace(costs, layer_cheap_forward_s=costs.layer_cheap_forward_s + recomputed,
                               layer_cheap_saved=costs.layer_saved - kept)


def titan_fused_norm_layer(costs: ModelCosts) -> ModelCosts:
    """What torchtitan's eager decoder layer keeps with its fused RMSNorm (its 2024 model code, the
    norm_type of its 8B and 13B configs) where picofx's keeps fp32 norms and residual stream and a
    decomposed SiLU: per token in bf16 each norm's input and output, q, k and v after the rotary
    embedding (a complex product with a buffer keeps only the buffer), attention's output and its
    contiguous copy, the gate's and up's outputs, the SiLU's and the product; in fp32 the norms'
    inverse RMS and attention's logsumexp per head."""
    c = costs.config
    h, kv, mlp = c.hidden_size, c.num_key_value_heads * c.head_dim, c.intermediate_size
    per_token = 2 * (7 * h + 2 * kv) + 2 * 4 * mlp + 4 * (2 + c.num_attention_heads)
    return dataclasses.replace(costs, layer_saved=costs.seq * per_token)


def loss_on_fp32_logits(costs: ModelCosts) -> ModelCosts:
    """Cross-entropy outside the compiled region on an fp32 copy of the logits: the log-softmax's
    fp32 output is kept for the backward, which starts with its gradient and the logits' gradient
    beside it (three fp32 vocabulary-wide tensors per token at once)."""
    logits = costs.seq * costs.config.vocab_size * 4
    return dataclasses.replace(costs, rest_saved=logits + costs.seq * costs.config.hidden_size * 2,
                               transient=2 * logits)


def unfused_attention(costs: ModelCosts, device, cost_model: CostModel, passes_run: tuple) -> ModelCosts:
    """Attention as Megatron ran it before FlashAttention: two batched matmuls of head_dim's depth
    over the whole score matrix (no causal half skipped) around a fused scale-mask-softmax and a
    dropout, each reading and writing the fp16 scores (forward 13 bytes per score: the first matmul's
    write, softmax, dropout with its mask, the second matmul's read; backward 19). Its selective
    recomputation runs this core again, not the memory-bound kernels around it."""
    c = costs.config
    fa = [{d: sum(k.seconds(device) for k in getattr(step, d) if k.attention) for d in ("forward", "backward")}
          for step in (planner_costs.capture(c, n, costs.seq, cost_model, passes_run) for n in (1, 2))]
    fa_fw, fa_bw = (fa[1][d] - fa[0][d] for d in ("forward", "backward"))
    scores = c.num_attention_heads * costs.seq ** 2
    flops = 4 * scores * c.head_dim
    rate, bandwidth = device.matmul_rate(torch.bfloat16, c.head_dim), device.pointwise_bandwidth()
    fw, bw = flops / rate + 13 * scores / bandwidth, 2 * flops / rate + 19 * scores / bandwidth
    return dataclasses.replace(costs, layer_forward_s=costs.layer_forward_s + fw - fa_fw,
                               layer_backward_s=costs.layer_backward_s + bw - fa_bw, layer_cheap_forward_s=fw)


def row(run: Published, profiles: dict) -> dict:
    device = profiles[run.gpu] if run.network is None else profiles[run.gpu].on(gpus.NETWORKS[run.network])
    config = run.model if not isinstance(run.model, str) else model_config(run.model)
    cost_model = CostModel(device)
    costs = weights_kept_in_bf16(model_costs(config, run.seq, cost_model, passes(run)))
    # float8 before the changes below, so that the matmuls they recompute run in float8
    b = run.global_batch // (run.layout.dp * run.layout.microbatches)
    costs = at_precision(costs, device, run.layout, b * run.seq // run.layout.cp)[0]
    if run.fused_norm_layer:
        costs = titan_fused_norm_layer(costs)
    if run.every_second_matmul:
        costs = every_second_matmul(costs)
    if run.loss_on_fp32_logits:
        costs = loss_on_fp32_logits(costs)
    if run.unfused_attention:
        costs = unfused_attention(costs, device, cost_model, passes(run))
    p = predict(Run(costs, device, run.gpus, 8, run.global_batch, run.sends_scattered, run.even_stages), run.layout)
    tokens = p.tokens_per_s / run.gpus
    published = run.tokens_per_gpu or run.mfu * device.flops_per_second(torch.bfloat16) / costs.flops_per_token
    # torch's reserved peak: the allocated peak the planner predicts and the caching allocator's share
    # it keeps beyond that (the same share a plan keeps free to fit)
    memory = p.memory_per_gpu / MAX_MEMORY_FRACTION / GiB
    return {"run": run.name, "source": run.source, "gpu": run.gpu, "network": run.network,
            "layout": p.layout.describe(),
            "fitted_on": run.fit, "predicted_tokens_per_s_per_gpu": tokens, "published_tokens_per_s_per_gpu": published,
            "error": tokens / published - 1, "predicted_mfu": p.mfu, "published_mfu": run.mfu,
            "predicted_memory_gib": memory, "published_memory_gib": run.memory_gib,
            "memory_error": memory / run.memory_gib - 1 if run.memory_gib else None, "fits": p.fits,
            "bottleneck": p.bottleneck, "time": p.time, "memory": p.memory}


def rows(profiles: dict | None = None) -> list[dict]:
    return [row(run, profiles or gpus.GPUS) for run in RUNS]


def fit() -> dict:
    """The fitted figures, each searched on a grid for the smallest mean |error| of tokens/s over the
    runs marked `fit` that it applies to: `sustained` (every GPU) on the A100 runs, then the 500 W
    H100's clock on its run with that `sustained`."""
    fitted = dict(gpus.FITTED)
    searches = (("sustained", ("a100-80gb",), lambda g, v: dataclasses.replace(g, sustained=v)),
                ("h100-96gb clock", ("h100-96gb",),
                 lambda g, v: dataclasses.replace(g, clock=v, sustained=fitted["sustained"])))
    for key, names, change in searches:
        runs = [r for r in RUNS if r.fit and r.gpu in names]
        scores = {}
        for value in [x / 100 for x in range(50, 101)]:
            profiles = {name: change(gpus.GPUS[name], value) for name in names}
            scores[value] = sum(abs(row(r, profiles)["error"]) for r in runs) / len(runs)
        fitted[key] = min(scores, key=scores.get)
        print(f"{key} = {fitted[key]:.2f}: mean |error| {scores[fitted[key]]:.1%} on {', '.join(r.name for r in runs)}")
    return fitted


def markdown(table: list[dict]) -> str:
    head = ("| run (source) | GPUs | layout | tokens/s/GPU predicted | published | error | memory GiB predicted "
            "| published | error |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in table:
        fitted = " **(fitted on)**" if r["fitted_on"] else ""
        mem_pub = f"{r['published_memory_gib']:.1f}" if r["published_memory_gib"] else "-"
        mem_err = f"{r['memory_error']:+.0%}" if r["memory_error"] is not None else "-"
        gpu = r["gpu"] + (f" on {r['network']}" if r["network"] else "")
        lines.append(f"| {r['run']}{fitted} ({r['source']}) | {gpu} | {r['layout']} | "
                     f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {r['published_tokens_per_s_per_gpu']:,.0f} | "
                     f"{r['error']:+.0%} | {r['predicted_memory_gib']:.1f} | {mem_pub} | {mem_err} |")
    checked = [r for r in table if not r["fitted_on"]]
    mean = sum(abs(r["error"]) for r in checked) / len(checked)
    worst = max(checked, key=lambda r: abs(r["error"]))
    memories = [abs(r["memory_error"]) for r in table if r["memory_error"] is not None]
    lines.append(f"\nChecked runs (not fitted on): {len(checked)}; mean |error| of tokens/s {mean:.1%}, worst "
                 f"{worst['error']:+.0%} ({worst['run']}); memory, where published: mean |error| "
                 f"{sum(memories) / max(len(memories), 1):.1%}, worst {max(memories, default=0):.0%}.")
    lines.append("\nNot expressible by the planner (listed, not predicted):\n")
    lines += [f"- {name} ({source}): {why}" for name, source, why in NOT_EXPRESSIBLE]
    return "\n".join(lines)


def write_docs(table: list[dict]) -> None:
    text = DOCS.read_text()
    block = f"{BEGIN}\n{markdown(table)}\n{END}"
    text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S) \
        if BEGIN in text else text + "\n" + block + "\n"
    DOCS.write_text(text)
    print(f"wrote the table into {DOCS}")


def read_captures(captures: str | None) -> None:
    """The captured steps a run before kept in `captures` (--captures), where it exists."""
    if captures and Path(captures).exists():
        planner_costs.CAPTURED.update(pickle.loads(Path(captures).read_bytes()))


def predicted(runs, captures: str | None) -> list[dict]:
    """Each run's row, the captured steps kept in `captures` after each (a stopped run loses none)."""
    table = []
    for run in runs:
        table.append(row(run, gpus.GPUS))
        if captures:
            Path(captures).write_bytes(pickle.dumps(planner_costs.CAPTURED))
    return table


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    p.add_argument("--write-docs", action="store_true", help=f"rewrite the table in {DOCS.name}")
    p.add_argument("--fit", action="store_true", help="search the fitted figures on the runs marked fit")
    p.add_argument("--captures", metavar="FILE", help="keep the captured steps in FILE (a pickle) and read them "
                                                     "from it next time: the captures are most of the run's time")
    args = p.parse_args(argv)
    read_captures(args.captures)
    if args.fit:
        fitted = fit()
        print(f"FITTED = {fitted}: set these in picofx/cost/gpus.py, then run again for the table")
        return []
    table = predicted(RUNS, args.captures)
    print(markdown(table))
    write_json(table, args.json, "plan_published.json")
    if args.write_docs:
        write_docs(table)
    return table


if __name__ == "__main__":
    main()
