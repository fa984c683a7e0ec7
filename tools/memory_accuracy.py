"""How close the cost model's peak-memory prediction is to the measured peak, with `checkpoint`.

    python tools/memory_accuracy.py [--sizes tiny,small,smollm-135m] [--backend eager|inductor]

For the reference LLaMA and Hugging Face Llama at each size, three budgets across what
`checkpoint` can reach: its smallest peak, and 50% and 90% of the way from there to the peak
without checkpointing.
Each runs `picofx.optimize(..., backend=...)`; the predicted peak is the pass's, the
measured one `picofx.memory.measure_peak` of a training step (live tensor bytes, CPU). With
inductor, the cost model counts only the buffers Inductor's fused kernels write.
"""
from __future__ import annotations

import argparse
import warnings

import torch

import picofx
from picofx.cost.units import format_bytes
from picofx.models import zoo
from picofx.cost.memory import measure_peak
from picofx.passes import Checkpoint
from picofx.planner.predict import smallest_peak
from picofx.planner.predict import predict
from results import write_json  # tools/results.py

SHAPES = {"tiny": (4, 64), "small": (4, 256), "smollm-135m": (2, 256)}  # (batch, seq) per size
FAMILIES = {"llama": zoo.reference_llama, "hf-llama": zoo.hf_llama}


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def measured_peak(z, passes, backend="eager") -> tuple[int, dict]:
    opt = picofx.optimize(z.model, z.example_inputs, passes, backend=backend, loss_fn=z.loss_fn)

    def step():
        z.model.zero_grad(set_to_none=True)
        _loss(opt(**z.example_inputs)).backward()

    step()
    z.model.zero_grad(set_to_none=True)
    record = opt.report.records[-1]
    return measure_peak(step, resident=(z.model, z.example_inputs)), {**record.notes, "pass_seconds": record.seconds}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,small,smollm-135m")
    parser.add_argument("--families", default="llama,hf-llama")
    parser.add_argument("--backend", choices=["eager", "inductor"], default="eager")
    parser.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    rows = []
    print(f"{'model':<10} {'size':<12} {'B':>2} {'T':>4} {'budget':>11} {'predicted':>11} {'measured':>11} "
          f"{'error':>7} {'pass s':>7}")
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            batch, seq = SHAPES[size]
            z = FAMILIES[family](size, batch, seq)
            none = predict(z.model, z.example_inputs, loss_fn=z.loss_fn, backend=args.backend).memory.peak
            low = smallest_peak(z.model, z.example_inputs, loss_fn=z.loss_fn, backend=args.backend)
            for budget in (low + int(f * (none - low)) for f in (0.0, 0.5, 0.9)):
                measured, notes = measured_peak(z, [Checkpoint(budget=budget)], args.backend)
                predicted = notes["peak_after"]
                row = {"model": family, "size": size, "batch": batch, "seq": seq, "budget": budget,
                       "predicted": predicted, "measured": measured, "error": predicted / measured - 1,
                       "pass_seconds": notes["pass_seconds"]}
                rows.append(row)
                print(f"{family:<10} {size:<12} {batch:>2} {seq:>4} {format_bytes(budget):>11} "
                      f"{format_bytes(predicted):>11} {format_bytes(measured):>11} {100 * row['error']:+6.2f}% "
                      f"{notes['pass_seconds']:7.1f}",
                      flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {100 * worst:.2f}% over {len(rows)} runs")
    write_json(rows, args.json, "memory_accuracy.json")
    return rows


if __name__ == "__main__":
    main()
