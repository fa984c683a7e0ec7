"""Benchmark: a training step with a checkpoint saved after every step, DCP in the background
against DCP in the step, on one process.

    python tools/bench_checkpoint_io.py [--steps 6] [--rounds 3] [--hidden 384 --layers 6] [--batch 2,8] [--threads 1] [--json PATH]

Contenders, each training its own copy of one LLaMA with AdamW (eager), measured side by side in
one run, in blocks of --steps steps taken in turn for --rounds rounds (so they share the
machine's load alike):
  no save     the step alone
  sync DCP    torch.distributed.checkpoint.save of the run's state (model, AdamW) after each step,
              then its completion marker (picofx.runtime.checkpoints.AsyncSaver(asynchronous=False))
  async DCP   the same through async_save: the state is copied, then written by a thread while the
              next step runs; a save first waits for the one before it (AsyncSaver)
For each: the median step (the training step plus the save call) and the median time the save
call held up the step ("blocks"; of which waiting for the write before it); the ratios are async
over sync. Target: async blocks at most 0.25x what the synchronous save blocks.

Each batch size in --batch is one such run. The checkpoint is the same size at every batch, the
step is not: where writing one checkpoint (what the synchronous save blocks) takes longer than a
step, a save after every step must wait for the disk whatever the saver does, at least the write
less the step, and the copy. Each run prints that floor beside what the background save
blocked, and says whether the target is judged there. Checkpoints go to a temporary directory
(--dir), the newest one kept.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from picofx.models.llama import Llama, LlamaConfig, causal_lm_loss
from picofx.runtime.checkpoints import AsyncSaver
from results import write_json  # tools/results.py

TARGET = 0.25  # async blocks / sync blocks


class Contender:
    def __init__(self, name: str, model: torch.nn.Module, saver: AsyncSaver | None):
        self.name, self.model, self.saver = name, model, saver
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.steps, self.saves, self.waits, self.count = [], [], [], 0

    def step(self, batch: torch.Tensor) -> None:
        started = time.perf_counter()
        causal_lm_loss(self.model(batch), batch).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.count += 1
        if self.saver is not None:
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            saving = time.perf_counter()
            self.saver.wait()  # inside save() too; timed apart: the write before this one, still going
            self.waits.append(time.perf_counter() - saving)
            self.saver.save({"model": model_state, "optimizer": optimizer_state}, self.count)
            self.saves.append(time.perf_counter() - saving)
        self.steps.append(time.perf_counter() - started)

    def row(self) -> dict:
        return {"contender": self.name, "step_s": statistics.median(self.steps),
                "blocks_s": statistics.median(self.saves) if self.saves else 0.0,
                "of_which_waiting_s": statistics.median(self.waits) if self.waits else 0.0, "steps": len(self.steps)}


def measure(args, config: LlamaConfig, batch_size: int, root: str) -> dict:
    """One run of the three contenders at `batch_size`."""
    torch.manual_seed(0)
    model = Llama(config)
    contenders = [Contender("no save", copy.deepcopy(model), None),
                  Contender("sync DCP", copy.deepcopy(model), AsyncSaver(f"{root}/sync", keep=1, asynchronous=False)),
                  Contender("async DCP", copy.deepcopy(model), AsyncSaver(f"{root}/async", keep=1))]
    batch = torch.randint(0, config.vocab_size, (batch_size, args.seq))
    for c in contenders:  # a first step each, not counted: allocations, AdamW's state
        c.step(batch)
        if c.saver is not None:
            c.saver.wait()
        c.steps, c.saves, c.waits = [], [], []
    for _ in range(args.rounds):
        for c in contenders:
            for _ in range(args.steps):
                c.step(batch)
            if c.saver is not None:
                c.saver.wait()  # the block's last write ends inside its block
    rows = [c.row() for c in contenders]
    bare, sync, async_ = rows
    copy_s = async_["blocks_s"] - async_["of_which_waiting_s"]
    # sync blocks = the write; the background write overlaps one step at most before the next save
    disk_floor_s = copy_s + max(0.0, sync["blocks_s"] - bare["step_s"])
    disk_bound = sync["blocks_s"] > bare["step_s"]
    return {"batch": batch_size, "tokens_per_step": batch_size * args.seq, "rows": rows,
            "write_s": sync["blocks_s"], "copy_s": copy_s, "disk_floor_s": disk_floor_s,
            "write_longer_than_step": disk_bound,
            "async_blocks_over_sync": async_["blocks_s"] / sync["blocks_s"],
            "disk_floor_over_sync": disk_floor_s / sync["blocks_s"],
            "async_step_over_sync": async_["step_s"] / sync["step_s"],
            "async_step_over_no_save": async_["step_s"] / bare["step_s"]}


def report(run: dict) -> None:
    print(f"\nbatch {run['batch']} x {run['tokens_per_step'] // run['batch']} tokens")
    print(f"{'contender':<12}{'step (s)':>10}{'save blocks (s)':>17}{'of which waiting for the last write (s)':>40}")
    for row in run["rows"]:
        print(f"{row['contender']:<12}{row['step_s']:>10.3f}{row['blocks_s']:>17.3f}{row['of_which_waiting_s']:>40.3f}")
    judged = "no: the write outlasts a step (the floor is the disk's)" if run["write_longer_than_step"] else "yes"
    print(f"async / sync: save blocks {run['async_blocks_over_sync']:.2f}x (target <= {TARGET}x; judged here: "
          f"{judged}), step {run['async_step_over_sync']:.2f}x; async step / no save: {run['async_step_over_no_save']:.2f}x")
    print(f"  the copy {run['copy_s']:.3f} s; a checkpoint's write {run['write_s']:.3f} s against a "
          f"{run['rows'][0]['step_s']:.3f} s step: a save after every step waits for the disk about "
          f"{run['disk_floor_s']:.3f} s ({run['disk_floor_over_sync']:.2f}x) whatever the saver does")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="steps per contender per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", default="2,8", help="batch sizes, one run each (comma-separated)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads (torchrun's default per rank is 1)")
    p.add_argument("--dir", help="where the checkpoints go (default: a new temporary directory)")
    p.add_argument("--json", help="write the results here (default: a file in a new temporary directory)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=r"torch.distributed is (disabled, )?unavailable or uninitialized")
    torch.set_num_threads(args.threads)
    config = LlamaConfig(vocab_size=8192, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, max_position_embeddings=args.seq)
    root = args.dir or tempfile.mkdtemp(prefix="picofx-checkpoint-io-")
    parameters = sum(p.numel() for p in Llama(config).parameters())
    checkpoint_bytes = parameters * 4 * 3  # fp32 parameters and AdamW's two moments
    print(f"{parameters / 1e6:.1f}M parameters, checkpoints of ~{checkpoint_bytes / 2**20:.0f} MiB (model and AdamW, "
          f"fp32), a save after every step; medians of {args.rounds} x {args.steps} steps each")
    runs = []
    for batch_size in (int(b) for b in args.batch.split(",")):
        runs.append(measure(args, config, batch_size, f"{root}/batch-{batch_size}"))
        report(runs[-1])
    judged = [r for r in runs if not r["write_longer_than_step"]]
    result = {"parameters": parameters, "checkpoint_bytes": checkpoint_bytes, "runs": runs,
              "target_blocks_ratio": TARGET, "settings": vars(args),
              "target_met": bool(judged) and all(r["async_blocks_over_sync"] <= TARGET for r in judged)}
    write_json(result, args.json, "bench_checkpoint_io.json")
    return result


if __name__ == "__main__":
    main()
