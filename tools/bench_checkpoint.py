"""Benchmark: activation checkpointing, picofx `checkpoint` against torch's options, on CPU.

    python tools/bench_checkpoint.py [--backend inductor|eager] [--batch 4 --seq 256] [--threads 1] [--fuse]

Contenders, measured side by side in one run (peak = live tensor bytes, params and grads
included, as picofx.memory.measure_peak defines it; time = median (and min) of --steps training
steps, taken round-robin across all contenders so that they share the machine's load alike):
  eager             plain PyTorch, nothing recomputed
  per-layer         torch.utils.checkpoint around every decoder layer (eager)
  torch budget=f    torch.compile with torch._functorch.config.activation_memory_budget = f
                    (backend inductor, or aot_eager_decomp_partition for --backend eager)
  picofx budget=B   picofx.optimize(..., [Checkpoint(budget=B)], backend=...): B runs from the
                    smallest feasible peak to no checkpointing, and includes each torch
                    contender's measured peak, so every contender has a picofx run at its peak.
                    With --fuse, picofx runs ["fuse", Checkpoint(budget=B)]: the whole product
                    rather than the checkpoint pass alone.
The comparison lines put each torch contender next to the fastest picofx run whose measured
peak is no higher, and give the floor: picofx's step without the checkpoint pass (Inductor's own
partition, or nothing recomputed under eager) over the contender's step. Recomputation only adds
work, so where the floor is near 1 the contender already runs at no-recompute speed and no
choice of what to recompute can beat it by much.
"""
from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
import warnings
from dataclasses import dataclass, field
from collections.abc import Callable

import torch
import torch.utils.checkpoint

import picofx
from picofx.cost.units import format_bytes
from picofx.models.llama import Llama, LlamaConfig, causal_lm_loss
from picofx.models.zoo import token_batch
from picofx.cost.memory import measure_peak
from picofx.errors import PassError
from picofx.passes import Checkpoint
from picofx.planner.predict import smallest_peak
from picofx.planner.predict import predict
from results import write_json  # tools/results.py

BENCH = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)


@dataclass
class Contender:
    name: str
    setting: str
    model: torch.nn.Module  # whose parameters the step trains
    step: Callable[[], None]
    row: dict = field(default_factory=dict)


def logits_step(model, inputs, forward=None):
    """A training step of `model` (or of `forward`, a compiled call of it): input_ids -> logits."""
    forward = forward or model

    def step():
        model.zero_grad(set_to_none=True)
        causal_lm_loss(forward(inputs["input_ids"]), inputs["labels"]).backward()
    return step


def eager(model, inputs, per_layer: bool) -> Contender:
    model = copy.deepcopy(model)
    if per_layer:
        for layer in model.decoder_layers:
            layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)
    return Contender("per-layer" if per_layer else "eager", "", model, logits_step(model, inputs))


def torch_budget(model, inputs, fraction: float, backend: str) -> Contender:
    model = copy.deepcopy(model)
    # Dynamo caches compiled code per code object and its guards accept any Llama instance, so
    # each contender compiles a function of its own (a fresh code object), under its own budget.
    namespace = {"model": model}
    exec("def forward(input_ids):\n    return model(input_ids)\n", namespace)
    compiled = torch.compile(namespace["forward"],
                             backend="inductor" if backend == "inductor" else "aot_eager_decomp_partition")
    step = logits_step(model, inputs, compiled)
    with torch._functorch.config.patch(activation_memory_budget=fraction):
        step()  # compiles now, under this budget
    return Contender("torch", f"budget={fraction}", model, step)


def picofx_budget(model, inputs, budget, backend: str, before: list) -> Contender:
    model = copy.deepcopy(model)
    passes = [*before] if budget is None else [*before, Checkpoint(budget=budget)]
    opt = picofx.optimize(model, inputs, passes, backend=backend, loss_fn=causal_lm_loss)
    notes = opt.report.records[-1].notes if budget is not None else {}

    def step():
        model.zero_grad(set_to_none=True)
        opt(**inputs).backward()

    setting = "+".join([*before, "none" if budget is None else f"budget={format_bytes(budget)}"])
    return Contender("picofx", setting, model, step,
                     {"budget": budget, "predicted": notes.get("peak_after"), "recomputed": notes.get("recomputed", 0),
                      "added_flops": notes.get("added_flops", 0)})


def measure_peaks(contenders: list[Contender], inputs) -> None:
    for c in contenders:
        c.step()  # warm up (and compile, where not done yet)
        c.step()
        c.model.zero_grad(set_to_none=True)
        c.row.update(contender=c.name, setting=c.setting, peak=measure_peak(c.step, resident=(c.model, inputs)))


def time_steps(contenders: list[Contender], steps: int) -> None:
    """Median step time of each, taken round-robin (one step of each per round) so that all
    share whatever else the machine is doing."""
    times = {id(c): [] for c in contenders}
    for _ in range(steps):
        for c in contenders:
            start = time.perf_counter()
            c.step()
            times[id(c)].append(time.perf_counter() - start)
    print(f"  {'contender':<9} {'setting':<22} {'peak':>11} {'median ms':>10} {'min ms':>8}  predicted peak")
    for c in sorted(contenders, key=lambda c: c.row["peak"]):
        c.row["ms"], c.row["min_ms"] = 1e3 * statistics.median(times[id(c)]), 1e3 * min(times[id(c)])
        print(f"  {c.name:<9} {c.setting:<22} {format_bytes(c.row['peak']):>11} {c.row['ms']:10.1f} "
              f"{c.row['min_ms']:8.1f}  {format_bytes(c.row['predicted']) if c.row.get('predicted') else ''}",
              flush=True)


def compare(rows: list[dict]) -> list[dict]:
    """Each torch/per-layer contender against the fastest picofx run whose measured peak is no
    higher (picofx ran at a budget equal to each contender's peak, so there is one)."""
    mine = [r for r in rows if r["contender"] == "picofx" and "ms" in r]
    unplanned = next((r for r in mine if r["budget"] is None), None)
    out = []
    for other in (r for r in rows if r["contender"] in ("torch", "per-layer")):
        fitting = [r for r in mine if r["peak"] <= other["peak"]]
        if fitting:
            best = min(fitting, key=lambda r: r["ms"])
            out.append({"versus": f"{other['contender']} {other['setting']}".strip(), "peak": other["peak"],
                        "their_ms": other["ms"], "picofx_ms": best["ms"], "picofx_peak": best["peak"],
                        "picofx_setting": best["setting"], "time_ratio": best["ms"] / other["ms"],
                        "floor_ratio": unplanned["ms"] / other["ms"] if unplanned else None})
    return out


def print_comparisons(comparisons: list[dict]) -> None:
    print("\nat equal peak: each contender against the fastest picofx run whose measured peak is no higher")
    print("  (floor: picofx's step with no checkpoint pass over their step; recomputation only adds work, so no\n"
          "   checkpoint plan's ratio can be much below it)")
    print(f"  {'versus':<20} {'their peak':>11} {'their ms':>9} {'picofx ms':>10} {'ratio':>6} {'floor':>6}  "
          f"{'picofx peak':>11}  picofx setting")
    for c in comparisons:
        floor = f"{c['floor_ratio']:6.2f}" if c["floor_ratio"] else f"{'':6}"
        print(f"  {c['versus']:<20} {format_bytes(c['peak']):>11} {c['their_ms']:9.1f} {c['picofx_ms']:10.1f} "
              f"{c['time_ratio']:6.2f} {floor}  {format_bytes(c['picofx_peak']):>11}  {c['picofx_setting']}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=BENCH.num_hidden_layers)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per contender (median)")
    parser.add_argument("--torch-budgets", default="0.0,0.1,0.3,0.5,0.7,1.0")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--fuse", action="store_true", help='picofx runs "fuse" before checkpoint')
    parser.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(**{**BENCH.__dict__, "num_hidden_layers": args.layers})
    model = Llama(config)
    ids = token_batch(config.vocab_size, args.batch, args.seq + 1)
    inputs = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    print(f"model: reference LLaMA {config}, batch {args.batch}, seq {args.seq}, backend {args.backend}, "
          f"{torch.get_num_threads()} threads", flush=True)
    others = [eager(model, inputs, per_layer=False), eager(model, inputs, per_layer=True)]
    others += [torch_budget(model, inputs, float(f), args.backend) for f in args.torch_budgets.split(",")]
    measure_peaks(others, inputs)
    before = ["fuse"] if args.fuse else []
    smallest = smallest_peak(copy.deepcopy(model), inputs, loss_fn=causal_lm_loss, backend=args.backend,
                             passes=before)
    base = predict(model, inputs, loss_fn=causal_lm_loss, backend=args.backend, passes=before).memory.peak
    budgets = sorted({smallest, *(int(f * base) for f in (0.6, 0.7, 0.8, 0.9)),
                      *(c.row["peak"] for c in others if c.name != "eager")})
    mine, rows = [], []
    for budget in [*budgets, None]:
        try:
            mine.append(picofx_budget(model, inputs, budget, args.backend, before))
        except PassError as e:
            reason = str(e.__cause__ or e).split(";")[0]
            rows.append({"contender": "picofx", "setting": f"budget={format_bytes(budget)}", "budget": budget,
                         "infeasible": reason})
            print(f"  picofx    budget={format_bytes(budget):<15} infeasible: {reason}", flush=True)
    measure_peaks(mine, inputs)
    time_steps(others + mine, args.steps)
    rows += [c.row for c in others + mine]
    comparisons = compare(rows)
    print_comparisons(comparisons)
    result = {"config": config.__dict__, "batch": args.batch, "seq": args.seq, "backend": args.backend,
              "picofx_passes": [*before, "checkpoint"],
              "threads": torch.get_num_threads(), "rows": rows, "comparisons": comparisons}
    print()
    write_json(result, args.json, "bench_checkpoint.json")
    return result


if __name__ == "__main__":
    main()
