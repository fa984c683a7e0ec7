"""Train a Hugging Face `LlamaForCausalLM` with `transformers.Trainer`, the model optimized by picofx.

A tiny Llama built from a `LlamaConfig` (no download) learns the Python standard library's own
source, byte by byte (256 tokens). `Trainer` runs as it would on the plain model: default
`TrainingArguments`, evaluation with `eval_loss`, checkpoints that `from_pretrained` loads.

    python examples/train_hf_trainer.py                                   # CPU, fuse + Inductor
    python examples/train_hf_trainer.py --backend eager --passes fuse precision checkpoint
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --passes fuse overlap   # data parallel
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --passes fuse shard     # sharded (FSDP-like)
    accelerate launch --multi_gpu --num_processes 2 examples/train_hf_trainer.py   # CPU ranks too (gloo)
"""
from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist

import picofx
from picofx.cli.train_data import stdlib_corpus
from picofx.models.zoo import hf_llama_config


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive windows of `seq` bytes; a causal LM's labels are its inputs (it shifts them)."""

    def __init__(self, tokens: torch.Tensor, seq: int):
        self.windows = tokens[: len(tokens) // seq * seq].view(-1, seq)  # (N, seq)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", help="model shape from picofx.models.llama.CONFIGS (vocab 256)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=8, help="per process")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--backend", choices=["inductor", "eager"], default="inductor")
    p.add_argument("--passes", nargs="*", default=["fuse"], help="e.g. fuse precision checkpoint overlap")
    p.add_argument("--output-dir", help="checkpoints (default: a new temporary directory, printed)")
    return p.parse_args(argv)


def fresh_shared_directory(process_index: int) -> str:
    """A new directory, made by the first process and named to the others: every rank writes its
    part of a checkpoint into the same one."""
    path = [tempfile.mkdtemp(prefix="picofx-hf-trainer-") if process_index == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(path, src=0)
    return path[0]


def main(argv=None) -> dict:
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    a = parse_args(argv)
    # TrainingArguments first: under torchrun or accelerate launch it sets up the process group,
    # which the overlap and shard passes read when picofx.optimize compiles the step. With shard the
    # checkpoints hold the model only (its gathered weights): Trainer does not save sharded optimizer state.
    args = TrainingArguments(output_dir=a.output_dir, use_cpu=True, save_only_model="shard" in a.passes,
                             report_to=[], max_steps=a.steps, per_device_train_batch_size=a.batch,
                             per_device_eval_batch_size=a.batch, learning_rate=3e-3, eval_strategy="steps",
                             eval_steps=max(a.steps // 2, 1), save_steps=max(a.steps // 2, 1),
                             logging_steps=max(a.steps // 10, 1), dataloader_drop_last=True, disable_tqdm=True)
    args.output_dir = a.output_dir or fresh_shared_directory(args.process_index)
    if args.process_index == 0:
        print(f"checkpoints go to {args.output_dir}")
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_llama_config(a.size, vocab_size=256))
    tokens = stdlib_corpus(400_000)
    split = int(0.95 * len(tokens))
    held_out = tokens[split:split + 8 * a.batch * a.seq]  # 8 evaluation batches
    train, val = ByteWindows(tokens[:split], a.seq), ByteWindows(held_out, a.seq)

    example = train.windows[: a.batch]  # (batch, seq), as Trainer will call the model
    # Trainer also passes the batch's label count to a model whose forward takes **kwargs:
    # capturing with it spares a second capture at the first step.
    opt = picofx.optimize(model, {"input_ids": example, "labels": example,
                                  "num_items_in_batch": torch.tensor(float(example[:, 1:].numel()))},
                          passes=a.passes, backend=a.backend)
    if args.process_index == 0:
        print(opt.report)  # the training step's passes
    trainer = Trainer(model=opt, args=args, train_dataset=train, eval_dataset=val)
    trainer.train()
    metrics = trainer.evaluate()
    if args.process_index == 0:
        print(f"eval_loss {metrics['eval_loss']:.3f}; checkpoints in {args.output_dir}")
    return {"history": trainer.state.log_history, "eval_loss": metrics["eval_loss"], "output_dir": args.output_dir,
            "model": model}


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # the group Trainer made: gloo's threads must not outlive the interpreter's teardown
        dist.destroy_process_group()
