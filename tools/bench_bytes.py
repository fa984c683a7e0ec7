"""Memory traffic per training step of each fused pattern against the unfused ops it replaces, at a
real model's shape, counted on fake tensors (nothing is allocated: runs on a laptop in a few minutes).

    python tools/bench_bytes.py                                   # Llama-3.2-1B at 4 x 2048 and Llama-3.1-8B at 1 x 8192
    python tools/bench_bytes.py --shapes llama-3.2-1b --gpu h100 --json bytes.json
    python tools/bench_bytes.py --counted-layers 1                # one capture per variant: the 1-layer step as it is

For each shape, Hugging Face's LlamaForCausalLM in bf16 (forward with the loss and backward) is
captured with and without `fuse`, partitioned as Inductor partitions it, and counted kernel by
kernel under picofx's model of Inductor's fusion (picofx.planner.pattern_bytes,
picofx.cost.inductor.traffic): bytes read and written from memory and kernels launched, per fuse rule
(what its fused ops move, against what the ops it replaces move), "other" (what no rule touches)
and the step. Counted at 1 and 2 layers of the real width and scaled to the model's layers. The
device (--gpu, a picofx.cost.device profile) reaches the passes through the cost model on ctx.
"""
from __future__ import annotations

import argparse
import sys
import time

from picofx.cost.device import devices
from picofx.planner.pattern_bytes import SHAPES, pattern_bytes, rows, table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--gpu", default="h200", choices=sorted(devices()), help="the device profile the passes see")
    p.add_argument("--layers", type=int, help="layers to scale to (default: the model's)")
    p.add_argument("--counted-layers", default="1,2", help="layer counts captured (two: scaled by layer)")
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    counted = tuple(int(n) for n in args.counted_layers.split(","))
    results = []
    for shape in args.shapes.split(","):
        began = time.perf_counter()
        result = pattern_bytes(shape, args.layers, args.gpu, counted)
        result["seconds"] = time.perf_counter() - began
        result["rows"] = rows(result)
        results.append(result)
        print(table(result) + f"\n(counted in {result['seconds']:.0f} s)\n", flush=True)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from results import write_json  # tools/results.py

    write_json({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}, args.json,
               "bench_bytes.json")
    return results


if __name__ == "__main__":
    main()
