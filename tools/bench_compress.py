"""Gradient compression side by side on 2 gloo ranks: the reference LLaMA trained with AdamW on
fresh random token walks, per compressor of the overlap pass and for DDP with torch's comm hooks.

    python tools/bench_compress.py --steps 200 [--runs LABELS] [--backend inductor] [--json FILE] [--html FILE]

Per run, every run stepping in turn on the same batches (one step of each per round): bytes each
rank puts on the wire per compressed step against an fp32 ring all-reduce (the pass's report; DDP's
hooks: their own arithmetic) and over the whole run (warm-up steps send fp32, int8 start steps int8),
the median step past the warm-up, its exposed communication (the step less the floor: the same step without
communication, picofx's for picofx, the plain model's for DDP), and the mean loss of the last 20
steps against uncompressed; `--html` draws the loss curves on one page. `--backend inductor`
compiles picofx with Inductor and DDP and its floor with torch.compile. On 2 CPU ranks the step
times say little about a GPU cluster; the bytes and losses are the point.

The cost model's step for Llama-2-7B on 2 nodes x 8 H100 (seq 4096) with each compressor comes
first, without ranks (`--predict-only` prints just it): for each replicated layout whose data
parallel crosses the nodes (tp inside a node), the fastest that fits uncompressed, then the same
with each compressor (picofx.planner.compress: the compressors' own wire bytes, the exposed part
of the exchange as the planner overlaps it, the compressor's passes over the gradient).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

from picofx.compression import START_STEPS
from picofx.cost.comm import all_reduce_bytes
from picofx.parallel.launch import run_ranks
from results import write_json  # tools/results.py

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "passes"))  # the ranks' scenarios
from compress_ranks import optimized, shard, walks  # noqa: E402

# (label, kind, warm-up as a fraction of the steps, int8 start steps): the first synced steps send whole
# gradients (Overlap's warmup; DDP's PowerSGD hook's start_powerSGD_iter), or, without a warm-up, a
# lossy compressor's first steps go as int8 (Overlap's start, by default 2 for PowerSGD)
RUNS = [("none", None, 0, 0), ("bf16", "bf16", 0, 0), ("sparse_rows", "sparse_rows", 0, 0),
        ("sparse_rows+int8", "sparse_rows+int8", 0, 0), ("int8:ef", "int8:ef", 0, 0), ("topk:0.01", "topk:0.01", 0, 0),
        ("topk:0.01 warm 1/2", "topk:0.01", 0.5, 0), ("powersgd:4", "powersgd:4", 0, START_STEPS),
        ("powersgd:4 cold", "powersgd:4", 0, 0), ("powersgd:4 warm 1/4", "powersgd:4", 0.25, 0),
        ("ddp bf16_compress_hook", "ddp:bf16", 0, 0), ("ddp powerSGD_hook:4", "ddp:powersgd", 0, 0),
        ("ddp powerSGD_hook:4 warm 1/4", "ddp:powersgd", 0.25, 0)]
FLOORS = [("floor picofx", "floor:picofx", 0, 0), ("floor torch", "floor:torch", 0, 0)]  # no communication
BATCH, SEQ, VOCAB, LR = 8, 32, 256, 3e-3
PREDICTED = (None, "bf16", "int8", "topk:0.01", "powersgd:4", "sparse_rows")


def predicted_steps(model="llama2-7b", gpus=16, per_node=8, seq=4096, global_batch=32, gpu="h100") -> dict:
    from picofx.cost.device import devices
    from picofx.cost.model import CostModel
    from picofx.planner.compress import exchange
    from picofx.planner.costs import model_costs
    from picofx.planner.layouts import Run, predict
    from picofx.planner.search import plan_layouts
    from picofx.planner.models import model_config

    config, device = model_config(model), devices()[gpu]
    run = Run(model_costs(config, seq, CostModel(device)), device, gpus, per_node, global_batch)
    plans, rows = plan_layouts(run), []
    for tp in (t for t in (8, 4, 2, 1) if gpus // t > 1 and gpus > per_node):
        best = next((p for p in plans if p.fits and (p.layout.tp, p.layout.pp, p.layout.shard) == (tp, 1, False)), None)
        if best is None:
            continue
        for kind in PREDICTED:
            layout = dataclasses.replace(best.layout, compress=kind)
            p = predict(run, layout)
            b = global_batch // (layout.dp * layout.microbatches)
            sent = exchange(config, layout, b * seq, device, run.link(layout.dp * layout.tp))
            rows.append({"layout": dataclasses.replace(layout, compress=None).describe(), "compress": kind or "none",
                         "wire_bytes": sent.wire_bytes, "fp32_ring_bytes": sent.fp32_ring_bytes,
                         "exchange_s": sent.link_s, "exposed_comm_s": p.time["data_parallel_exposed"],
                         "compressor_s": p.time["compression"], "step_s": p.step_s, "embedding": sent.rows})
        base = rows[-len(PREDICTED)]["step_s"]
        for r in rows[-len(PREDICTED):]:
            r["vs_none"] = r["step_s"] / base
    return {"model": model, "gpus": gpus, "gpus_per_node": per_node, "gpu": device.name, "seq": seq,
            "global_batch": global_batch, "link": device.inter_node_link.name, "rows": rows}


def print_predicted(out: dict) -> None:
    print(f"predicted: {out['model']} on {out['gpus'] // out['gpus_per_node']} nodes x {out['gpus_per_node']} "
          f"{out['gpu']} ({out['link']} between nodes), seq {out['seq']}, global batch {out['global_batch']}")
    print(f"{'layout':30} {'compressor':12} {'wire/GPU':>9} {'x fp32':>7} {'exposed s':>10} {'codec s':>8} "
          f"{'step s':>8} {'x none':>7}")
    for r in out["rows"]:
        note = "" if r["embedding"] in ("", "rows") else f"  embedding {r['embedding']}"
        ratio = r["wire_bytes"] / r["fp32_ring_bytes"]
        print(f"{r['layout']:30} {r['compress']:12} {r['wire_bytes'] / 1e9:8.3f}G {ratio:7.3f}"
              f" {r['exposed_comm_s']:10.4f} {r['compressor_s']:8.4f} {r['step_s']:8.4f} {r['vs_none']:7.3f}{note}")


def ddp_model(kind: str, model, warm_steps: int):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    if kind == "ddp:bf16":  # register_comm_hook refuses the bf16 hook without NCCL; gloo sums bf16 on CPU
        dist._register_comm_hook(ddp.reducer, None, default_hooks.bf16_compress_hook)
    else:  # torch's hook needs start_powerSGD_iter >= 2 (its first steps build DDP's buckets)
        state = psgd.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=warm_steps)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    return ddp


def ddp_wire_bytes(kind: str, model, world: int) -> int:
    if kind == "ddp:bf16":
        return all_reduce_bytes(sum(2 * p.numel() for p in model.parameters()), world)
    kept = 0
    for p in model.parameters():
        rows, cols = p.shape[0], p[0].numel() if p.dim() > 1 else 1
        low = (rows + cols) * 4
        kept += low if p.dim() > 1 and 2 * low < rows * cols else p.numel()
    return all_reduce_bytes(4 * kept, world)


def contender(kind, warm_steps: int, start: int, rank: int, world: int, backend: str):
    """(the model, its step: batch -> loss, bytes on the wire per compressed step)."""
    import picofx
    from picofx.models import zoo

    if kind is not None and kind.startswith(("ddp:", "floor:torch")):
        z = zoo.build("llama-tiny", batch=BATCH)
        model = z.model if kind == "floor:torch" else ddp_model(kind, z.model, warm_steps)
        wire = 0 if kind == "floor:torch" else ddp_wire_bytes(kind, z.model, world)
        model = model if backend == "eager" else torch.compile(model, backend=backend)
        return z.model, lambda data: z.loss_fn(model(data["input_ids"]), data["labels"]), wire
    if kind == "floor:picofx":
        z = zoo.build("llama-tiny", batch=BATCH)
        opt = picofx.optimize(z.model, shard(z.example_inputs, rank, world), [], backend=backend, loss_fn=z.loss_fn)
        return z.model, lambda data: opt(**data), 0
    z, opt = optimized(kind, rank, world, BATCH, backend=backend, warmup=warm_steps, start=start)
    notes = next(r.notes for r in opt.report.records if r.name == "overlap" and r.notes.get("buckets"))
    return z.model, lambda data: opt(**data), notes["wire_bytes"]


def start_bytes(kind: str, model, world: int) -> int:
    """Bytes each rank sends in one of a lossy compressor's int8 start steps (the int8 all-reduce of
    every gradient, in the blocks the pass lays out per bucket; one bucket's layout is close enough)."""
    from picofx.compression import Int8

    return Int8().wire_bytes([tuple(p.shape) for p in model.parameters()], 4, world)


def train(rank: int, world: int, steps: int, runs: list, backend: str) -> dict:
    """Every run trains its own model on the same batches, one step of each run per round (a noisy
    neighbour slows all alike); per run its losses, median step and bytes on the wire."""
    import torch.distributed as dist

    live = {}
    for label, kind, warm, start in runs:
        warm_steps = max(2, round(warm * steps)) if kind == "ddp:powersgd" else round(warm * steps)
        model, step_fn, wire = contender(kind, warm_steps, start, rank, world, backend)
        first = start_bytes(kind, model, world) if start else 0
        live[label] = (model, step_fn, torch.optim.AdamW(model.parameters(), lr=LR), wire, warm_steps, start, first)
    losses = {label: [] for label in live}
    times = {label: [] for label in live}
    for step in range(steps):
        data = shard(walks(VOCAB, BATCH, SEQ, seed=1000 + step), rank, world)
        for label, (model, step_fn, optimizer, *_) in live.items():
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            out = step_fn(data)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            loss.backward()
            optimizer.step()
            times[label].append(time.perf_counter() - start)
            loss = loss.detach()
            dist.all_reduce(loss)
            losses[label].append(loss.item() / world)
    out = {}
    for label, (model, _, _, wire, warm_steps, start, first) in live.items():
        ring = all_reduce_bytes(sum(4 * p.numel() for p in model.parameters()), world)
        compressed = times[label][max(5, warm_steps, start):] or times[label]  # past compile and the warm-up
        run = warm_steps * ring + start * first + (steps - warm_steps - start) * wire
        out[label] = {"losses": losses[label], "step_ms": 1e3 * statistics.median(compressed),
                      "wire_bytes": wire, "fp32_ring_bytes": ring, "warmup_steps": warm_steps, "start_steps": start,
                      "run_wire_bytes": run / steps}
    return out


def print_runs(results: dict) -> None:
    base = statistics.mean(results["none"]["losses"][-20:])
    floors = {"picofx": results.pop("floor picofx")["step_ms"], "torch": results.pop("floor torch")["step_ms"]}
    print(f"floor (no communication): picofx {floors['picofx']:.1f} ms, torch {floors['torch']:.1f} ms per step")
    print(f"{'run':30} {'wire/step':>10} {'x fp32':>7} {'run x fp32':>10} {'step ms':>8} {'exposed ms':>11} "
          f"{'last-20 loss':>13} {'x none':>7}")
    for label, r in results.items():
        r["last20"] = statistics.mean(r["losses"][-20:])
        r["exposed_ms"] = r["step_ms"] - floors["torch" if label.startswith("ddp") else "picofx"]
        print(f"{label:30} {r['wire_bytes']:>10} {r['wire_bytes'] / r['fp32_ring_bytes']:>7.3f} "
              f"{r['run_wire_bytes'] / r['fp32_ring_bytes']:>10.3f} {r['step_ms']:>8.1f} {r['exposed_ms']:>11.1f} "
              f"{r['last20']:>13.4f} {r['last20'] / base:>7.3f}")
    results["floors_ms"] = floors


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    parser.add_argument("--predict-only", action="store_true", help="print the cost model's Llama-2-7B table only")
    parser.add_argument("--global-batch", type=int, default=32, help="sequences per step of the prediction")
    parser.add_argument("--gpus", type=int, default=16, help="H100s of the prediction, 8 per node")
    parser.add_argument("--backend", default="eager", help="picofx's backend; DDP and the floor under "
                                                           "torch.compile with it unless eager")
    parser.add_argument("--html", metavar="FILE", help="also write the runs' loss curves as one HTML page")
    parser.add_argument("--runs", metavar="LABELS", help="only these runs, comma-separated labels of the table "
                                                         "('none' always runs: the others are compared with it)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PICOFX_CACHE", "0")
    predicted = predicted_steps(gpus=args.gpus, global_batch=args.global_batch)
    print_predicted(predicted)
    if args.predict_only:
        return
    runs = RUNS
    if args.runs:
        wanted = {"none", *(label.strip() for label in args.runs.split(","))}
        unknown = wanted - {r[0] for r in RUNS}
        if unknown:
            parser.error(f"--runs: no run named {', '.join(sorted(unknown))}; "
                         f"the runs: {', '.join(r[0] for r in RUNS)}")
        runs = [r for r in RUNS if r[0] in wanted]
    results = run_ranks(train, 2, args.steps, runs + FLOORS, args.backend, timeout=3600, collective_timeout=600)[0]
    print_runs(results)
    write_json({"steps": args.steps, "batch": BATCH, "seq": SEQ, "lr": LR, "backend": args.backend, "runs": results,
                "predicted": predicted}, args.json, "bench_compress.json")
    if args.html:
        from picofx.report_html import write_html

        curves = {label: r["losses"] for label, r in results.items() if label != "floors_ms"}
        print(f"wrote {write_html(args.html, losses=curves, title='picofx: gradient compression on 2 ranks', subtitle=f'reference LLaMA, AdamW {LR:g}, {args.steps} steps of fresh token walks')}")


if __name__ == "__main__":
    main()
