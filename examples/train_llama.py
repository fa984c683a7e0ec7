"""Train the reference LLaMA with picofx on a corpus already on the machine.

The corpus is the Python standard library's own source (no download), read as bytes: the
tokenizer is byte-level (256 tokens). Prints per-interval loss and tokens/s, then picofx's report.

    python examples/train_llama.py                          # CPU, fuse + Inductor, 200 steps
    python examples/train_llama.py --backend eager --steps 50 --passes
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sysconfig
import time

import torch
from tqdm import tqdm

import picofx
from picofx.cost.model import CostModel
from picofx.cost.device import device_for
from picofx.examples.llama import CONFIGS, Llama, causal_lm_loss


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files, as token ids (one per byte)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class Batches:
    """Random windows of seq+1 bytes: inputs and next-byte labels (already shifted, as the seed does)."""

    def __init__(self, tokens: torch.Tensor, batch: int, seq: int, seed: int):
        split = int(0.95 * len(tokens))
        self.train, self.val = tokens[:split], tokens[split:]
        self.batch, self.seq = batch, seq
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, split: str = "train") -> dict:
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - self.seq - 1, (self.batch,), generator=self.generator)
        windows = torch.stack([data[s:s + self.seq + 1] for s in starts.tolist()])  # (B, T+1)
        return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}


def throughput_line(model: Llama, opt_model, tokens_per_s: float, batch: int, seq: int, device: str) -> str:
    """tokens/s, MFU in the PaLM convention (6 x matmul parameters + 12 x layers x hidden x seq FLOPs
    per token, embedding excluded), and the FLOPs the captured graphs really hold, beside it."""
    config = model.config
    matmul_params = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embedding" not in name)
    palm_per_token = 6 * matmul_params + 12 * config.num_hidden_layers * config.hidden_size * seq
    spec = device_for(device)
    peak = spec.flops_per_second(torch.float32)
    cost = CostModel(spec)
    graph_per_token = (cost.graph_flops(opt_model.graphs["forward"]) +
                       cost.graph_flops(opt_model.graphs["backward"])) / (batch * seq)
    return (f"{tokens_per_s:,.0f} tokens/s; MFU {palm_per_token * tokens_per_s / peak:.1%} of {spec.name} "
            f"({peak / 1e9:,.0f} GFLOP/s fp32, {spec.source}); {palm_per_token / 1e6:.2f} MFLOP/token by "
            f"6N+12LHT, {graph_per_token / 1e6:.2f} MFLOP/token in the captured graphs")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(CONFIGS), default="tiny", help="model shape (vocab set to 256)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", choices=["inductor", "eager"], default="inductor")
    p.add_argument("--passes", nargs="*", default=["fuse"], help="picofx passes, e.g. fuse precision checkpoint")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--dump-dir", help="write every graph picofx produced to this directory")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    config = dataclasses.replace(CONFIGS[args.size], vocab_size=256, max_position_embeddings=max(args.seq, 128))
    model = Llama(config).to(args.device)
    batches = Batches(stdlib_corpus(max_bytes=4_000_000), args.batch, args.seq, args.seed)
    first = {k: v.to(args.device) for k, v in batches.sample().items()}

    start = time.perf_counter()
    opt_model = picofx.optimize(model, first, passes=args.passes, backend=args.backend, loss_fn=causal_lm_loss,
                                dump_dir=args.dump_dir)
    print(f"picofx: captured and compiled in {time.perf_counter() - start:.1f}s "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, passes={args.passes})")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))

    history, interval_loss, interval_tokens, interval_start = [], 0.0, 0, time.perf_counter()
    progress = tqdm(range(args.steps), desc="train", unit="step")
    for step in progress:
        batch = first if step == 0 else {k: v.to(args.device) for k, v in batches.sample().items()}
        loss = opt_model(**batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        interval_loss += loss.item()
        interval_tokens += batch["input_ids"].numel()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            seconds = time.perf_counter() - interval_start
            steps_in_interval = (step % args.log_every) + 1
            entry = {"step": step + 1, "loss": interval_loss / steps_in_interval,
                     "tokens_per_s": interval_tokens / seconds}
            history.append(entry)
            progress.write(f"step {entry['step']:5d}  loss {entry['loss']:.4f}  {entry['tokens_per_s']:,.0f} tokens/s")
            interval_loss, interval_tokens, interval_start = 0.0, 0, time.perf_counter()

    with torch.no_grad():
        model.eval()
        val = batches.sample("val")
        val_loss = causal_lm_loss(model(val["input_ids"]), val["labels"]).item()
    print(f"\nloss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f} (validation {val_loss:.3f})")
    print(throughput_line(model, opt_model, history[-1]["tokens_per_s"], args.batch, args.seq, args.device))
    print("\n" + opt_model.report.table())
    return {"history": history, "val_loss": val_loss}


if __name__ == "__main__":
    main()
