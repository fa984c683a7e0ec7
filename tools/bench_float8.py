"""Benchmark `Precision(float8=...)`: numerics on the CPU, speed on a GPU.

    python tools/bench_float8.py                                  # CPU: the numerics table
    python tools/bench_float8.py --mode speed --device cuda       # GPU: Llama-3.2-1B and 8B shapes
    python tools/bench_float8.py --mode speed --device cuda --shapes llama-3.1-8b --layers 4 --json f8.json

numerics (the tiny reference LLaMA, float8_layers="all", one step of each recipe): the first loss
and the gradients of picofx's float8, of torchao's `convert_to_float8_training` under CPU autocast
(its float8 layers fed bf16 inputs, as torchao's autocast does on CUDA), and of picofx's bf16; each
against torchao's float8: the loss's relative difference and the largest relative gradient error.

speed (a training step: forward with the loss, backward, AdamW, zero_grad; bf16 policy everywhere):
    torch.compile bf16        torch.compile(model + loss) under autocast
    torchao float8 + compile  convert_to_float8_training, then the same torch.compile
    picofx float8             picofx.optimize(["fuse", Precision(float8=recipe)], backend="inductor")
Rounds run each contender once in turn; tokens/s from the median step after the warm-up; peak
memory from max_memory_allocated. `--layers` cuts the decoder to fit one GPU (an 8B model's AdamW
state alone is 128 GB); the per-layer shapes, which decide float8's gain, stay the model's.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
import warnings

import torch

import picofx
from picofx.models.llama import Llama, LlamaConfig, causal_lm_loss
from picofx.models.zoo import reference_llama, token_batch
from picofx.passes import Precision
from results import write_json  # tools/results.py

SHAPES = {  # Meta's configs (config.json of each on the Hugging Face hub)
    "llama-3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
    "llama-3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
}
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["numerics", "speed"], default="numerics")
    p.add_argument("--device", default="cpu")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--shapes", default=",".join(SHAPES), help="speed: model shapes to run")
    p.add_argument("--layers", type=int, default=None, help="speed: decoder layers kept (default: the model's)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="speed: timed rounds after the warm-up")
    p.add_argument("--warmup", type=int, default=2, help="speed: untimed rounds; the first compiles")
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    return p.parse_args(argv)


def torchao_float8(model, recipe: str):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    converted = convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    for module in converted.modules():
        if isinstance(module, Float8Linear):  # torchao casts to the autocast dtype on CUDA only
            module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16),))
    return converted


def first_step(loss_fn, model) -> tuple[float, list]:
    loss = loss_fn()
    loss.backward()
    return loss.item(), [p.grad.detach().clone() for p in model.parameters()]


def numerics(args) -> dict:
    rows = {}
    for recipe in args.recipes.split(","):
        z = reference_llama("tiny")
        batch = z.example_inputs
        runs = {}
        for name in ("picofx float8", "torchao float8", "picofx bf16"):
            model = copy.deepcopy(z.model)
            if name == "torchao float8":
                model = torchao_float8(model, recipe)

                def loss_fn(model=model):
                    with torch.autocast("cpu", torch.bfloat16):
                        return causal_lm_loss(model(batch["input_ids"]), batch["labels"])
            else:
                precision = Precision(float8=recipe, float8_layers="all") if "float8" in name else Precision()
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=r"Precision\(float8=...\) on the CPU")
                    opt = picofx.optimize(model, batch, [precision], backend="eager", loss_fn=causal_lm_loss)
                loss_fn = (lambda opt=opt: opt(**batch))
            runs[name] = first_step(loss_fn, model)
        ref_loss, ref_grads = runs["torchao float8"]
        rows[recipe] = {name: {"first_loss": loss, "loss_vs_torchao": abs(loss - ref_loss) / ref_loss,
                               "grad_error_vs_torchao": max(((g - r).norm() / r.norm()).item()
                                                            for g, r in zip(grads, ref_grads))}
                        for name, (loss, grads) in runs.items()}
    return {"mode": "numerics", "model": "reference LLaMA tiny", "float8_layers": "all", "recipes": rows}


def speed_contender(name: str, model, batch: dict, recipe: str):
    if name == "picofx float8":
        opt = picofx.optimize(model, batch, ["fuse", Precision(float8=recipe)], backend="inductor",
                              loss_fn=causal_lm_loss)
        return lambda: opt(**batch)
    if name == "torchao float8 + compile":
        model = torchao_float8(model, recipe)
    compiled = torch.compile(lambda ids, labels: causal_lm_loss(model(ids), labels))

    def step():
        with torch.autocast(batch["input_ids"].device.type, torch.bfloat16):
            return compiled(batch["input_ids"], batch["labels"])
    return step


def speed(args) -> dict:
    device, results = torch.device(args.device), {}
    recipe = args.recipes.split(",")[0]
    for shape in args.shapes.split(","):
        config = SHAPES[shape]
        config = dataclasses.replace(config, num_hidden_layers=args.layers or config.num_hidden_layers)
        torch.manual_seed(0)
        base = Llama(config).to(device)
        ids = token_batch(config.vocab_size, args.batch, args.seq + 1).to(device)
        batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
        contenders = {}
        for name in ("torch.compile bf16", "torchao float8 + compile", "picofx float8"):
            model = copy.deepcopy(base)
            contenders[name] = (speed_contender(name, model, batch, recipe),
                                torch.optim.AdamW(model.parameters(), lr=1e-4), [], [])
        for round_index in range(args.warmup + args.steps):
            for name, (loss_fn, optimizer, times, peaks) in contenders.items():
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                start = time.perf_counter()
                loss_fn().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    peaks.append(torch.cuda.max_memory_allocated(device))
                if round_index >= args.warmup:
                    times.append(time.perf_counter() - start)
        tokens = args.batch * args.seq
        results[shape] = {name: {"tokens_per_s": tokens / statistics.median(times), "step_seconds": times,
                                 "peak_bytes": max(peaks) if peaks else None}
                          for name, (_, _, times, peaks) in contenders.items()}
    return {"mode": "speed", "device": str(device), "recipe": recipe, "batch": args.batch, "seq": args.seq,
            "layers": args.layers, "shapes": results}


def table(results: dict) -> str:
    if results["mode"] == "numerics":
        lines = [f"{results['model']}, float8_layers={results['float8_layers']}: one step, against torchao float8",
                 f"{'recipe':<20}{'contender':<16}{'first loss':>12}{'loss vs torchao':>17}{'grad err vs torchao':>21}"]
        for recipe, rows in results["recipes"].items():
            for name, r in rows.items():
                lines.append(f"{recipe:<20}{name:<16}{r['first_loss']:>12.6f}{r['loss_vs_torchao']:>17.2e}"
                             f"{r['grad_error_vs_torchao']:>21.3f}")
        return "\n".join(lines)
    lines = [f"{results['device']}, recipe {results['recipe']}, batch {results['batch']} x seq {results['seq']}",
             f"{'shape':<14}{'contender':<26}{'tokens/s':>10}{'vs compile':>12}{'peak GiB':>10}"]
    for shape, rows in results["shapes"].items():
        base = rows["torch.compile bf16"]["tokens_per_s"]
        for name, r in rows.items():
            peak = f"{r['peak_bytes'] / 2**30:.1f}" if r["peak_bytes"] else "-"
            lines.append(f"{shape:<14}{name:<26}{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / base:>11.2f}x{peak:>10}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    results = numerics(args) if args.mode == "numerics" else speed(args)
    print(table(results))
    write_json(results, args.json, "bench_float8.json")


if __name__ == "__main__":
    main()
