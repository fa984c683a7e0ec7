"""Benchmark pass `precision` and check that it trains like fp32.

1. Training check: the tiny reference LLaMA trained for 150 AdamW steps on a learnable synthetic
   language in fp32, with picofx's `precision` (bf16) and with torch.autocast(bf16), from the same
   initial weights on the same batches; the final loss (mean of the last 10 steps) of each, and
   its deviation from fp32's.
2. Benchmark: training-step time (median; forward, backward, AdamW step) and peak memory of
   `precision` (bf16) against fp32 through picofx (eager backend, and Inductor), and of
   torch.autocast(bf16) against fp32 in plain PyTorch (eager, and torch.compile), all measured
   side by side in one run.

    python tools/bench_precision.py                                  # both, llama-small on CPU
    python tools/bench_precision.py --model llama-tiny --batch 8 --seq 64 --json out.json
    python tools/bench_precision.py --skip-training --device cuda    # on a GPU
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import picofx
from picofx.models import zoo
from picofx.cost.memory import measure_peak
from picofx.testing import markov_batches, train_losses
from results import write_json  # tools/results.py

MODES = ("fp32", "precision", "autocast")
# (mode, backend); each row is compared with the fp32 row of its backend (the same pipeline):
# "eager" is plain PyTorch, "picofx eager" / "picofx inductor" picofx.optimize with that backend,
# "torch.compile" torch.compile of the plain step (Inductor).
CONTENDERS = (("fp32", "eager"), ("autocast", "eager"),
              ("fp32", "picofx eager"), ("precision", "picofx eager"),
              ("fp32", "picofx inductor"), ("precision", "picofx inductor"),
              ("fp32", "torch.compile"), ("autocast", "torch.compile"))


def model_loss(z: zoo.ZooModel, model, batch: dict) -> torch.Tensor:
    if z.loss_fn is None:
        return model(**batch).loss
    return z.loss_fn(model(**{k: v for k, v in batch.items() if k != "labels"}), batch["labels"])


def make_step(mode: str, backend: str, z: zoo.ZooModel, model, example: dict, device: torch.device):
    """The contender's `batch -> loss`."""
    if backend.startswith("picofx"):
        opt = picofx.optimize(model, example, ["precision"] if mode == "precision" else [],
                              backend=backend.split()[1], loss_fn=z.loss_fn)
        return lambda batch: _loss(opt(**batch))

    def plain(batch):
        with torch.autocast(device.type, torch.bfloat16, enabled=mode == "autocast"):
            return model_loss(z, model, batch)

    return torch.compile(plain) if backend == "torch.compile" else plain


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def training_check(steps: int, batch: int, seq: int, lr: float) -> dict:
    z = zoo.reference_llama("tiny", batch=batch, seq=seq)
    batches = markov_batches(z.model.config.vocab_size, batch, seq, steps)
    result = {"steps": steps, "batch": batch, "seq": seq, "lr": lr}
    for mode in MODES:
        model = copy.deepcopy(z.model)
        step = make_step(mode, "picofx eager" if mode == "precision" else "eager", z, model, batches[0],
                         torch.device("cpu"))
        losses = train_losses(step, model.parameters(), batches, lr=lr)
        result[mode] = {"first_loss": losses[0], "final_loss": statistics.fmean(losses[-10:])}
    for mode in ("precision", "autocast"):
        fp32 = result["fp32"]["final_loss"]
        result[mode]["deviation"] = (result[mode]["final_loss"] - fp32) / fp32
    return result


def benchmark(name: str, batch: int, seq: int, warmup: int, steps: int, device: torch.device) -> list[dict]:
    """Build every contender (compiling it), then time them in rounds, one step of each per round, so
    that load from elsewhere on the machine falls on all of them alike; then measure each one's peak."""
    z = zoo.build(name, batch=batch, seq=seq)
    z.model.to(device)
    example = {k: v.to(device) for k, v in z.example_inputs.items()}
    contenders = []
    for mode, backend in CONTENDERS:
        model = copy.deepcopy(z.model)
        start = time.perf_counter()
        step_loss = make_step(mode, backend, z, model, example, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train_step = _train_step(step_loss, optimizer, example)
        train_step()  # the first call compiles
        row = {"mode": mode, "backend": backend, "build_s": time.perf_counter() - start, "times": []}
        for _ in range(warmup):
            train_step()
        contenders.append((row, train_step, step_loss, model, optimizer))
    for _ in range(steps):
        for row, train_step, *_ in contenders:
            _sync(device)
            t0 = time.perf_counter()
            train_step()
            _sync(device)
            row["times"].append(time.perf_counter() - t0)
    rows = []
    for row, train_step, step_loss, model, optimizer in contenders:
        row["step_ms"] = 1e3 * statistics.median(row.pop("times"))
        row["peak_mib"] = measure_peak(train_step, resident=(model, optimizer), device=device) / 2**20
        # Without the optimizer's step, whose temporaries can hide the activations' peak.
        row["fwd_bwd_peak_mib"] = measure_peak(lambda: step_loss(example).backward(), resident=(model, optimizer),
                                               device=device) / 2**20
        optimizer.zero_grad(set_to_none=True)
        rows.append(row)
    return rows


def _train_step(step_loss, optimizer, batch: dict):
    def train_step():
        step_loss(batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_table(rows: list[dict]) -> None:
    fp32 = {r["backend"]: r for r in rows if r["mode"] == "fp32"}
    print(f"{'contender':<30}{'step ms':>9}{'vs fp32':>9}{'peak MiB':>10}{'vs fp32':>9}"
          f"{'fwd+bwd MiB':>13}{'vs fp32':>9}{'build s':>9}")
    for r in rows:
        base = fp32[r["backend"]]
        print(f"{r['mode'] + ' (' + r['backend'] + ')':<28}{r['step_ms']:>9.1f}{r['step_ms'] / base['step_ms']:>8.2f}x"
              f"{r['peak_mib']:>10.1f}{r['peak_mib'] / base['peak_mib']:>8.2f}x"
              f"{r['fwd_bwd_peak_mib']:>13.1f}{r['fwd_bwd_peak_mib'] / base['fwd_bwd_peak_mib']:>8.2f}x"
              f"{r['build_s']:>9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-small", help="zoo model for the benchmark (default: llama-small)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per contender (median reported)")
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-benchmark", action="store_true")
    parser.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = {"torch": torch.__version__, "device": str(device), "threads": torch.get_num_threads()}
    if not args.skip_training:
        check = training_check(args.train_steps, batch=8, seq=32, lr=3e-3)
        results["training"] = check
        print(f"training check: tiny LLaMA, {check['steps']} AdamW steps (lr {check['lr']:g}, batch "
              f"{check['batch']}x{check['seq']}), final loss = mean of the last 10 steps")
        for mode in MODES:
            deviation = check[mode].get("deviation")
            versus = f"  ({deviation:+.2%} vs fp32)" if deviation is not None else ""
            print(f"  {mode:<10} {check[mode]['final_loss']:.4f}{versus}")
    if not args.skip_benchmark:
        rows = benchmark(args.model, args.batch, args.seq, args.warmup, args.steps, device)
        results["benchmark"] = {"model": args.model, "batch": args.batch, "seq": args.seq, "rows": rows}
        print(f"\nbenchmark: {args.model}, batch {args.batch}x{args.seq}, {device}, {torch.get_num_threads()} threads, "
              f"median of {args.steps} steps; peak = parameters + gradients + AdamW state + the step's allocations "
              f"(fwd+bwd: without the optimizer step)")
        print_table(rows)
    print()
    write_json(results, args.json, "bench_precision.json")


if __name__ == "__main__":
    main()
