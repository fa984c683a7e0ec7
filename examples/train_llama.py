"""Train the reference LLaMA with picofx on a corpus already on the machine.

The corpus is the Python standard library's own source (no download), read as bytes: the
tokenizer is byte-level (256 tokens). Shows a progress bar and per-interval loss and tokens/s,
then a summary (tokens/s over the run, MFU) and picofx's report.

    python examples/train_llama.py                          # CPU, fuse + Inductor, 200 steps
    python examples/train_llama.py --backend eager --steps 50 --passes
    torchrun --nproc-per-node 2 examples/train_llama.py --dp 2                # 2 replicas, pass overlap
    torchrun --nproc-per-node 2 examples/train_llama.py --pp 2                # 2 pipeline stages
    torchrun --nproc-per-node 4 examples/train_llama.py --dp 2 --pp 2         # 2 stages x 2 replicas, pass overlap
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import pathlib
import sysconfig
import time

import torch
from tqdm import tqdm

import picofx
from picofx.cost.model import CostModel, compute_dtype, node_flops
from picofx.cost.device import device_for
from picofx.cost.units import format_bytes
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


def step_dtype(graphs) -> torch.dtype:
    """The dtype most of the step's FLOPs are computed in (bf16 under the precision pass)."""
    flops: collections.Counter = collections.Counter()
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op == "call_function":
                flops[compute_dtype(node)] += node_flops(node)
    return max(flops, key=flops.get) if flops else torch.float32


def throughput_line(model: Llama, opt_model, tokens_per_s: float, batch: int, seq: int, device: str) -> str:
    """MFU in the PaLM convention (6 x matmul parameters + 12 x layers x hidden x seq FLOPs per
    token, embedding excluded) against the device's peak for the dtype the step computes in, and
    the FLOPs the captured graphs really hold, beside it."""
    config = model.config
    matmul_params = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embedding" not in name)
    palm_per_token = 6 * matmul_params + 12 * config.num_hidden_layers * config.hidden_size * seq
    spec = device_for(device)
    graphs = [opt_model.graphs["forward"], opt_model.graphs["backward"]]
    dtype = step_dtype(graphs)
    peak = spec.flops_per_second(dtype)
    cost = CostModel(spec)
    graph_per_token = sum(cost.graph_flops(g) for g in graphs) / (batch * seq)
    dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    return (f"MFU {100 * palm_per_token * tokens_per_s / peak:.3g}% of its {dtype_name} peak on {spec.name} "
            f"({peak / 1e9:,.0f} GFLOP/s, {spec.source}); {palm_per_token / 1e6:.2f} MFLOP/token by "
            f"6N+12LHT, {graph_per_token / 1e6:.2f} MFLOP/token in the captured graphs")


def step_bytes(config, batch: int, seq: int) -> int:
    """A step's memory, roughly: fp32 weights, gradients and AdamW's two moments (16 bytes per
    parameter), saved activations of 2 x (34 x hidden + 5 x heads x seq) bytes per token and layer
    (Korthikanti et al.'s 16-bit estimate, doubled for fp32), and the logits with their gradient."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * config.head_dim
    params = 2 * config.vocab_size * h + layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h
    tokens = batch * seq
    activations = tokens * layers * 2 * (34 * h + 5 * config.num_attention_heads * seq)
    return 16 * params + activations + 2 * 4 * tokens * config.vocab_size


def fits(size: str, batch: int, seq: int, device: str) -> bool:
    config = dataclasses.replace(CONFIGS[size], vocab_size=256)
    return step_bytes(config, batch, seq) <= device_for(device).memory_capacity


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and gives every option's default."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    default_device = "cpu"
    offered = [size for size in CONFIGS if fits(size, 8, 128, default_device)]
    p.add_argument("--size", choices=sorted(CONFIGS), default="tiny", metavar="SIZE",
                   help=f"model shape, vocabulary set to 256; on {default_device} at the default batch and "
                        f"sequence: {', '.join(offered)} (a size whose step does not fit the device is refused)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (20 steps of warm-up)")
    p.add_argument("--device", default=default_device, help="torch device: cpu, cuda, cuda:1")
    p.add_argument("--backend", choices=["inductor", "eager"], default="inductor",
                   help="inductor generates code (20-30 s to compile on CPU); eager runs the graphs as they are")
    p.add_argument("--passes", nargs="*", default=["fuse"], help="picofx passes, e.g. fuse precision checkpoint")
    p.add_argument("--log-every", type=int, default=25, help="steps between loss and tokens/s lines")
    p.add_argument("--dump-dir", help="write every graph picofx produced to this directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the batches")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (pass pipeline; run under torchrun)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (run under torchrun)")
    p.add_argument("--schedule", default="1F1B", help="pipeline schedule: GPipe, 1F1B, Interleaved1F1B")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step and replica under --pp")
    p.add_argument("--measure-cuts", action=argparse.BooleanOptionalAction, default=True,
                   help="under --pp, cut where unit times measured on rank 0 balance (--no-measure-cuts: predicted)")
    args = p.parse_args(argv)
    if not fits(args.size, args.batch, args.seq, args.device):
        config = dataclasses.replace(CONFIGS[args.size], vocab_size=256)
        p.error(f"--size {args.size} needs about {format_bytes(step_bytes(config, args.batch, args.seq))} per step "
                f"at batch {args.batch}, seq {args.seq}; {args.device} has "
                f"{format_bytes(device_for(args.device).memory_capacity)}: pick a smaller size, batch or sequence")
    return args


def parallel_passes(args) -> list:
    """--pp and --dp: a process group (torchrun's), and the passes that use it."""
    if args.pp == 1 and args.dp == 1:
        return []
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo",
                            timeout=datetime.timedelta(minutes=5))
    if args.pp == 1:
        return ["overlap"]
    mesh = init_device_mesh(args.device.split(":")[0], (args.dp, args.pp), mesh_dim_names=("dp", "pp"))
    pipeline = picofx.passes.Pipeline(stages=args.pp, schedule=args.schedule, microbatches=args.microbatches,
                                      virtual=2 if "Interleaved" in args.schedule else 1, group=mesh,
                                      measure=args.measure_cuts)
    return [pipeline, *(["overlap"] if args.dp > 1 else [])]  # each stage's grads averaged in its backward


def clip_gradients(parameters, max_norm: float, replicas: int | None) -> None:
    """Clip by the norm of the whole model's gradients. Pipelined (`replicas` given), each rank holds
    one stage's: their squares are summed over all ranks, less the replicas' equal copies."""
    parameters = list(parameters)
    if replicas is None:
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    square = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    dist.all_reduce(square)
    scale = min(1.0, max_norm / ((square / replicas).sqrt().item() + 1e-6))
    for g in grads:
        g.mul_(scale)


def main(argv=None) -> dict:
    args = parse_args(argv)
    extra_passes = parallel_passes(args)
    torch.manual_seed(args.seed)
    config = dataclasses.replace(CONFIGS[args.size], vocab_size=256, max_position_embeddings=max(args.seq, 128))
    model = Llama(config).to(args.device)
    replica = torch.distributed.get_rank() // args.pp if extra_passes else 0  # ranks of one pipeline share batches
    speaks = not extra_passes or torch.distributed.get_rank() == 0  # under torchrun rank 0 prints
    say = print if speaks else (lambda *_, **__: None)
    batches = Batches(stdlib_corpus(max_bytes=4_000_000), args.batch, args.seq, args.seed + replica)
    first = {k: v.to(args.device) for k, v in batches.sample().items()}

    start = time.perf_counter()
    opt_model = picofx.optimize(model, first, passes=[*args.passes, *extra_passes], backend=args.backend,
                                loss_fn=causal_lm_loss, dump_dir=args.dump_dir)
    say(f"picofx: captured and compiled in {time.perf_counter() - start:.1f}s "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, passes={args.passes})")
    optimizer = torch.optim.AdamW(opt_model.parameters(), lr=args.lr, weight_decay=0.01)  # pipelined: this stage's
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))

    history, interval_loss, interval_tokens, interval_start = [], 0.0, 0, time.perf_counter()
    run_start, run_tokens = interval_start, 0
    progress = tqdm(range(args.steps), desc="train", unit="step", disable=not speaks)
    for step in progress:
        batch = first if step == 0 else {k: v.to(args.device) for k, v in batches.sample().items()}
        loss = opt_model.forward_backward(**batch)
        clip_gradients(opt_model.parameters(), 1.0, args.dp if args.pp > 1 else None)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        interval_loss += loss.item()
        interval_tokens += batch["input_ids"].numel()
        run_tokens += batch["input_ids"].numel()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            seconds = time.perf_counter() - interval_start
            steps_in_interval = (step % args.log_every) + 1
            entry = {"step": step + 1, "loss": interval_loss / steps_in_interval,
                     "tokens_per_s": interval_tokens / seconds}
            history.append(entry)
            if speaks:
                progress.write(f"step {entry['step']:5d}  loss {entry['loss']:.4f}  {entry['tokens_per_s']:,.0f} tokens/s")
            progress.set_postfix(loss=f"{entry['loss']:.3f}", tokens_per_s=f"{entry['tokens_per_s']:,.0f}")
            interval_loss, interval_tokens, interval_start = 0.0, 0, time.perf_counter()

    val = {k: v.to(args.device) for k, v in batches.sample("val").items()}
    if args.pp == 1:
        with torch.no_grad():
            val_loss = causal_lm_loss(model.eval()(val["input_ids"]), val["labels"]).item()
    else:  # a rank holds one stage: the loss comes through the schedule, whose gradients are dropped
        val_loss = opt_model.forward_backward(**val).item()
        optimizer.zero_grad(set_to_none=True)
    run_seconds = time.perf_counter() - run_start
    tokens_per_s = run_tokens / run_seconds
    report = opt_model.report
    say(f"\nsummary: {args.size}, {args.steps} steps of {args.batch} x {args.seq} tokens on {args.device}, "
          f"backend {args.backend}, passes {' '.join(args.passes) or '(none)'}")
    say(f"  loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f} (validation {val_loss:.3f})")
    if args.dp > 1:  # replicas step in lockstep on batches of the same size
        say(f"  tokens/s across {args.dp} data-parallel replicas: {tokens_per_s * args.dp:,.0f}")
    say(f"  tokens/s: {tokens_per_s:,.0f} over the run ({run_tokens:,} tokens in {run_seconds:.1f}s), "
          f"{history[-1]['tokens_per_s']:,.0f} in the last interval")
    say("  " + throughput_line(model, opt_model, tokens_per_s, args.batch, args.seq, args.device))
    say(f"  picofx: capture {report.capture_seconds:.1f}s, compile {report.compile_seconds:.1f}s, "
          f"{report.recompilations} recompilations")
    say("\n" + report.table())
    if extra_passes:
        torch.distributed.destroy_process_group()
    return {"history": history, "val_loss": val_loss, "tokens_per_s": tokens_per_s}


if __name__ == "__main__":
    main()
