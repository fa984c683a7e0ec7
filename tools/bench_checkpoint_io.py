"""Benchmark: a training step with a checkpoint saved after every step, DCP in the background
against DCP in the step, on one process.

    python tools/bench_checkpoint_io.py [--steps 6] [--rounds 3] [--hidden 384 --layers 6] [--threads 1] [--json PATH]

Contenders, each training its own copy of one LLaMA with AdamW (eager), measured side by side in
one run, in blocks of --steps steps taken in turn for --rounds rounds (so they share the
machine's load alike):
  no save     the step alone
  sync DCP    torch.distributed.checkpoint.save of the run's state (model, AdamW) after each step,
              then its completion marker (picofx.runtime.checkpoints.AsyncSaver(asynchronous=False))
  async DCP   the same through async_save: the state is copied, then written by a thread while the
              next step runs; a save first waits for the one before it (AsyncSaver)
For each: the median step (the training step plus the save call) and the median time the save
call held up the step ("blocks"; of which waiting for the write before it, where the
write takes longer than a step); the ratios are async over sync. Target: async blocks at most
0.25x what the synchronous save blocks. Checkpoints go to a temporary directory (--dir), the
newest one kept.
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="steps per contender per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads (torchrun's default per rank is 1)")
    p.add_argument("--dir", help="where the checkpoints go (default: a new temporary directory)")
    p.add_argument("--json", help="write the results here (default: a file in a new temporary directory)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=r"torch.distributed is (disabled, )?unavailable or uninitialized")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, max_position_embeddings=args.seq)
    model = Llama(config)
    root = args.dir or tempfile.mkdtemp(prefix="picofx-checkpoint-io-")
    contenders = [Contender("no save", copy.deepcopy(model), None),
                  Contender("sync DCP", copy.deepcopy(model), AsyncSaver(f"{root}/sync", keep=1, asynchronous=False)),
                  Contender("async DCP", copy.deepcopy(model), AsyncSaver(f"{root}/async", keep=1))]
    batch = torch.randint(0, config.vocab_size, (args.batch, args.seq))
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
    sync, async_ = rows[1], rows[2]
    parameters = sum(p.numel() for p in model.parameters())
    result = {"parameters": parameters, "checkpoint_bytes": parameters * 4 * 3, "rows": rows,
              "async_blocks_over_sync": async_["blocks_s"] / sync["blocks_s"],
              "async_step_over_sync": async_["step_s"] / sync["step_s"],
              "async_step_over_no_save": async_["step_s"] / rows[0]["step_s"], "target_blocks_ratio": 0.25,
              "settings": vars(args)}
    print(f"{parameters / 1e6:.1f}M parameters, checkpoints of ~{result['checkpoint_bytes'] / 2**20:.0f} MiB (model and "
          f"AdamW, fp32), a save after every step; medians of {args.rounds} x {args.steps} steps each")
    print(f"{'contender':<12}{'step (s)':>10}{'save blocks (s)':>17}{'of which waiting for the last write (s)':>40}")
    for row in rows:
        print(f"{row['contender']:<12}{row['step_s']:>10.3f}{row['blocks_s']:>17.3f}{row['of_which_waiting_s']:>40.3f}")
    print(f"async / sync: save blocks {result['async_blocks_over_sync']:.2f}x (target <= 0.25x), "
          f"step {result['async_step_over_sync']:.2f}x; async step / no save: {result['async_step_over_no_save']:.2f}x")
    write_json(result, args.json, "bench_checkpoint_io.json")
    return result


if __name__ == "__main__":
    main()
