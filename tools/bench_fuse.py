"""Benchmark the `fuse` pass: training step time and peak memory, eager vs torch.compile vs picofx.

    python tools/bench_fuse.py                      # reference LLaMA "small" (vocab 32000), batch 8 x 512
    python tools/bench_fuse.py --batch 2 --steps 7 --json bench_fuse.json
    python tools/bench_fuse.py --device cuda --dtype bfloat16   # on a GPU

A step is what a training loop does per batch: forward with the loss, backward, AdamW step,
zero_grad(set_to_none=True). The optimizer is the same eager AdamW for every contender, on its own
copy of the same initial model:
    eager          the model and `causal_lm_loss` as written
    torch.compile  torch.compile(model + loss), default options (Inductor)
    picofx         picofx.optimize(passes=["fuse"], backend="inductor")
Steps run round-robin (one step of each contender per round) so that load on the machine affects
all alike; the time is the median over rounds after the warm-up (which includes compilation).
Peak memory is that of one step, parameters, gradients and optimizer state included
(picofx.memory.measure_peak: live tensor bytes on CPU, max_memory_allocated on CUDA).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch

import picofx
from picofx.models.llama import CONFIGS, Llama, causal_lm_loss
from picofx.models.zoo import token_batch
from picofx.cost.memory import measure_peak
from results import write_json  # tools/results.py

TARGET_PEAK_RATIO = 0.6  # picofx peak / torch.compile peak, on CPU (issue 3)
TARGET_TIME_RATIO = 1.0  # picofx step time / torch.compile step time, on CPU


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(CONFIGS), default="small")
    p.add_argument("--vocab", type=int, default=None, help="override the config's vocab size")
    # 8 x 512 tokens: enough that the logits, not the parameters and optimizer state, set the peak
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=9, help="timed rounds after the warm-up")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds; the first compiles")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--contenders", default="eager,torch.compile,picofx")
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    return p.parse_args(argv)


def make_contender(name: str, model: torch.nn.Module, batch: dict):
    """A function that runs one forward with the loss and returns the loss."""
    inputs = {"input_ids": batch["input_ids"]}
    if name == "eager":
        return lambda: causal_lm_loss(model(**inputs), batch["labels"])
    if name == "torch.compile":
        compiled = torch.compile(lambda ids, labels: causal_lm_loss(model(ids), labels))
        return lambda: compiled(batch["input_ids"], batch["labels"])
    if name == "picofx":
        opt = picofx.optimize(model, batch, passes=["fuse"], backend="inductor", loss_fn=causal_lm_loss)
        return lambda: opt(**batch)
    raise ValueError(f"unknown contender {name!r}")


@dataclasses.dataclass
class Contender:
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: object
    times: list = dataclasses.field(default_factory=list)
    losses: list = dataclasses.field(default_factory=list)
    peak_bytes: int = 0

    def step(self) -> float:
        loss = self.loss_fn()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = dataclasses.replace(CONFIGS[args.size], vocab_size=args.vocab or CONFIGS[args.size].vocab_size)
    config = dataclasses.replace(config, max_position_embeddings=max(config.max_position_embeddings, args.seq))
    torch.manual_seed(0)
    base = Llama(config).to(device=device, dtype=dtype)
    ids = token_batch(config.vocab_size, args.batch, args.seq + 1).to(device)
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    contenders = []
    for name in args.contenders.split(","):
        model = copy.deepcopy(base)
        contenders.append(Contender(name, model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                    make_contender(name, model, batch)))
    for round_index in range(args.warmup + args.steps):
        for c in contenders:
            synchronize(device)
            start = time.perf_counter()
            c.losses.append(c.step())
            synchronize(device)
            if round_index >= args.warmup:
                c.times.append(time.perf_counter() - start)
    for c in contenders:
        c.peak_bytes = measure_peak(c.step, resident=(c.model, c.optimizer, batch), device=device)
    params = sum(p.numel() for p in base.parameters())
    return {"config": dataclasses.asdict(config), "params": params, "batch": args.batch, "seq": args.seq,
            "device": str(device), "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup,
            "step": "forward with loss + backward + AdamW step + zero_grad",
            "contenders": {c.name: {"median_step_seconds": statistics.median(c.times), "step_seconds": c.times,
                                    "peak_bytes": c.peak_bytes, "first_loss": c.losses[0], "last_loss": c.losses[-1]}
                           for c in contenders}}


def table(results: dict) -> str:
    rows = [["contender", "step (ms, median)", "peak memory (MiB)", "time / compile", "peak / compile",
             "loss 1st -> last"]]
    ref = results["contenders"].get("torch.compile")
    for name, r in results["contenders"].items():
        time_ratio = f"{r['median_step_seconds'] / ref['median_step_seconds']:.2f}x" if ref else "-"
        peak_ratio = f"{r['peak_bytes'] / ref['peak_bytes']:.2f}x" if ref else "-"
        rows.append([name, f"{r['median_step_seconds'] * 1e3:.0f}", f"{r['peak_bytes'] / 2**20:.0f}", time_ratio,
                     peak_ratio, f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    c = results["config"]
    head = (f"reference LLaMA: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, vocab {c['vocab_size']}, "
            f"{results['params'] / 1e6:.1f}M params; batch {results['batch']} x seq {results['seq']}; "
            f"{results['device']} {results['dtype']}; step = {results['step']}")
    if ref and "picofx" in results["contenders"] and results["device"] == "cpu":
        p = results["contenders"]["picofx"]
        peak_met = p["peak_bytes"] <= TARGET_PEAK_RATIO * ref["peak_bytes"]
        time_met = p["median_step_seconds"] <= TARGET_TIME_RATIO * ref["median_step_seconds"]
        head += (f"\ntargets (CPU): peak <= {TARGET_PEAK_RATIO}x torch.compile's ({'met' if peak_met else 'missed'}), "
                 f"step time <= {TARGET_TIME_RATIO}x ({'met' if time_met else 'missed'})")
    return head + "\n" + "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    results = run(args)
    print(table(results))
    write_json(results, args.json, "bench_fuse.json")


if __name__ == "__main__":
    main()
