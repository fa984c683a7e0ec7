"""Measure one LLaMA training step on one GPU: eager, torch.compile, picofx, Liger-Kernel + torch.compile.

    python tools/bench_gpu.py                       # Llama-3.2-1B shape, batch 8 x 2048, on cuda
    python tools/bench_gpu.py --json gpu.json --steps 10
    python tools/bench_gpu.py --device cpu --shape tiny --batch 2 --seq 64 --steps 2   # a dry run
    python tools/bench_gpu.py --profile 3           # also a torch.profiler trace of 3 steps of each contender

Every contender trains the same model, Hugging Face's LlamaForCausalLM (the model Liger-Kernel
patches), from the same initial weights on the same batch: fp32 parameters and AdamW state,
matmuls and attention in bf16 (mixed precision, what `picofx plan` predicts for; `--precision bf16`:
parameters and AdamW state in bf16 too, no autocast, picofx without `precision`). A step is the
forward with the loss, backward, AdamW step and zero_grad(set_to_none=True):
    eager          torch.autocast(bf16) around the model as written
    torch.compile  torch.compile(model), under torch.autocast(bf16)
    picofx         picofx.optimize(passes=["fuse", "precision"], backend="inductor"): the fused ops
                   run picofx's Triton kernels on CUDA, the rest Inductor's
    liger          liger_kernel's apply_liger_kernel_to_llama(model=...) (RoPE, RMSNorm, SwiGLU,
                   fused linear cross-entropy), then torch.compile, under torch.autocast(bf16)
Rounds are interleaved (one step of each contender per round, the order rotated each round); the
figures are medians over the rounds after the warm-up. MFU: training FLOPs per step over the step
time and the GPU's dense bf16 peak (picofx.cost.device); FLOPs = 6 x tokens x matmul parameters
(lm head included, embedding not) + 6 x tokens x layers x seq x hidden (causal attention: the
scores and the weighted sum over the seq/2 earlier tokens on average, forward and twice that
backward). Peak memory: the step's max_memory_allocated over what was allocated before it, plus
the contender's own parameters, gradients, optimizer state and batch (picofx.cost.memory).
The planner's prediction for the same run (`picofx.plan(..., world=1)`, its plain layout) is
printed against the picofx contender's measured step and peak.
--profile N: after the timed rounds, N more steps of each contender under torch.profiler (a Chrome
trace per contender, which Perfetto opens), and a table of device time per kind of work (matmul,
attention, rms_norm, swiglu, rope, loss, optimizer, ...: picofx's kernels against what
torch.compile generated for the same ops) with the SDPA backend each attention call ran, from
`picofx.runtime.attribution`; the picofx contender's time also per graph node and fused pattern.
Inductor names its kernels after the graph nodes they fuse (`descriptive_names="inductor_node"`).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from contextlib import nullcontext

import torch

SHAPES = {  # Hugging Face LlamaConfig fields
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
CONTENDERS = ("eager", "torch.compile", "picofx", "liger")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers kept (default: the shape's); each layer keeps the model's width, so an 8B "
                        "model's layer shapes fit one card beside its optimizer state")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8, help="timed rounds after the warm-up")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds; the first compiles")
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=("mixed", "bf16"), default="mixed",
                   help="mixed: fp32 parameters and AdamW state, bf16 compute (autocast; picofx's precision "
                        "pass); bf16: parameters and AdamW state in bf16 (half the resident memory), no autocast")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--planner", action=argparse.BooleanOptionalAction, default=True,
                   help="also the planner's prediction for this run (its CPU work takes a minute)")
    p.add_argument("--profile", type=int, nargs="?", const=3, default=0, metavar="STEPS",
                   help="trace STEPS more steps of each contender with torch.profiler (default 3 when given)")
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    return p.parse_args(argv)


def hf_config(shape: str, seq: int, layers: int | None = None):
    from transformers import LlamaConfig

    fields = {**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}
    return LlamaConfig(**fields, max_position_embeddings=seq, rms_norm_eps=1e-5, use_cache=False,
                       attn_implementation="sdpa")


def hf_model(shape: str, seq: int, layers: int | None = None):
    from transformers import LlamaForCausalLM

    config = hf_config(shape, seq, layers)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def training_flops(config, tokens: int, seq: int) -> float:
    h, kv = config.hidden_size, config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * config.intermediate_size
    matmul_params = config.num_hidden_layers * per_layer + h * config.vocab_size
    return 6 * tokens * matmul_params + 6 * tokens * config.num_hidden_layers * seq * h


class LigerRope:
    """Liger's patch replaces modeling_llama.apply_rotary_pos_emb for every Llama in the process:
    this puts it back for the other contenders and swaps Liger's in around the liger forward only."""

    def __init__(self):
        from transformers.models.llama import modeling_llama

        self.module, self.original = modeling_llama, modeling_llama.apply_rotary_pos_emb

    def patch(self, model):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
        self.liger = self.module.apply_rotary_pos_emb
        self.module.apply_rotary_pos_emb = self.original

    def __enter__(self):
        self.module.apply_rotary_pos_emb = self.liger

    def __exit__(self, *exc):
        self.module.apply_rotary_pos_emb = self.original


def make_forward(name: str, model, batch: dict, device: torch.device, mixed: bool):
    """A function running one forward with the loss under the contender's precision; returns the loss."""
    import picofx

    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16) if mixed else nullcontext()  # noqa: E731
    if name == "eager":
        run, scope = model, nullcontext
    elif name == "torch.compile":
        run, scope = torch.compile(model), nullcontext
    elif name == "picofx":
        began = time.perf_counter()
        opt = picofx.optimize(model, batch, passes=["fuse", "precision"] if mixed else ["fuse"],
                              backend="inductor")
        print(f"picofx.optimize: {time.perf_counter() - began:.1f}s (capture {opt.report.capture_seconds:.1f}s, "
              f"compile {opt.report.compile_seconds:.1f}s)", flush=True)
        forward = lambda: opt(**batch).loss  # noqa: E731
        forward.graphs = opt.graphs  # what --profile attributes the kernels to
        return forward
    elif name == "liger":
        rope = LigerRope()
        rope.patch(model)
        run, scope = torch.compile(model), lambda: rope
    else:
        raise ValueError(f"bench_gpu: unknown contender {name!r}; choose from {', '.join(CONTENDERS)}")

    def forward():
        with scope(), autocast():
            return run(**batch).loss
    return forward


class Contender:
    def __init__(self, name, model, forward, optimizer):
        self.name, self.model, self.forward, self.optimizer = name, model, forward, optimizer
        self.times, self.losses, self.error = [], [], None

    def step(self):
        loss = self.forward()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def timed(fn, device: torch.device) -> tuple:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - begin


def matmul_rate(device: torch.device, n: int = 8192, repeats: int = 10) -> float | None:
    """bf16 FLOP/s of an n x n x n product on random data, the median of `repeats` (CUDA only)."""
    if device.type != "cuda":
        return None
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * n**3 / statistics.median(timed(lambda: a @ b, device)[1] for _ in range(repeats))


def planner_prediction(config, args, gpu: str | None) -> dict:
    """`picofx.plan`'s prediction for this run on one GPU: its plain layout (no checkpointing)."""
    if gpu is None:
        return {"error": "no GPU profile for this device"}
    try:
        import picofx

        plans = picofx.plan(config, world=1, seq=args.seq, global_batch=args.batch, gpu=gpu)
        plain = [p for p in plans.predictions if p.layout.microbatches == 1 and "ckpt" not in p.layout.describe()]
        p = plain[0]
        return {"layout": p.layout.describe(), "step_seconds": p.step_s, "memory_bytes": p.memory_per_gpu,
                "fits": p.fits, "mfu": p.mfu}
    except Exception as e:  # the benchmark's figures stand without it
        return {"error": f"{type(e).__name__}: {e}"}


def gpu_profile(device: torch.device):
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    key = next((k for k in ("h200", "h100", "a100") if k in name.lower()), None)
    try:
        from picofx.cost.device import devices
    except ImportError:
        traceback.print_exc()
        return key, None
    return key, devices()[key] if key else None


def step_peak(c: Contender, batch: dict, device: torch.device) -> int | None:
    try:
        from picofx.cost.memory import measure_peak
    except ImportError:  # picofx itself does not import here: the other contenders' figures still stand
        traceback.print_exc()
        return None
    return measure_peak(c.step, resident=(c.model, c.optimizer, batch), device=device)


def run(args) -> dict:
    device = torch.device(args.device)
    base = hf_model(args.shape, args.seq, args.layers).to(device, torch.float32 if args.precision == "mixed" else torch.bfloat16)
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
    contenders = []
    for name in args.contenders.split(","):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        try:
            contenders.append(Contender(name, model, make_forward(name, model, batch, device, args.precision == "mixed"), optimizer))
        except Exception as e:
            contenders.append(Contender(name, model, None, optimizer))
            contenders[-1].error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    del base
    for index in range(args.warmup + args.steps):
        order = contenders[index % len(contenders):] + contenders[:index % len(contenders)]
        for c in order:
            if c.error:
                continue
            try:
                loss, seconds = timed(c.step, device)
            except Exception as e:
                c.error = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                continue
            c.losses.append(loss.item())
            if index >= args.warmup:
                c.times.append(seconds)
            print(f"round {index}: {c.name} {seconds * 1e3:.1f} ms, loss {c.losses[-1]:.4f}", flush=True)
    for c in contenders:
        c.peak = None if c.error else step_peak(c, batch, device)
    out = results(args, contenders, device)
    if args.profile:
        out["profile"] = profiles(contenders, args.profile, device)
    return out


def profiles(contenders, steps: int, device: torch.device) -> dict:
    """Each contender's `steps` steps under torch.profiler: a trace file and the attribution."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from picofx.runtime.attribution import attribute

    folder = tempfile.mkdtemp(prefix="picofx-profile-")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out = {}
    for c in contenders:
        if c.error:
            continue
        with profile(activities=activities) as prof:
            for _ in range(steps):
                c.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        trace = f"{folder}/{c.name.replace('.', '_')}.json"
        prof.export_chrome_trace(trace)
        graphs = getattr(c.forward, "graphs", None) or {}
        found = attribute(prof.events(), {k: graphs[k] for k in ("forward", "backward") if k in graphs})
        out[c.name] = {**found.as_dict(), "steps": steps, "trace": trace}
        print(f"profiled {c.name}: {trace}", flush=True)
    return out


def results(args, contenders, device) -> dict:
    config = contenders[0].model.config
    tokens = args.batch * args.seq
    flops = training_flops(config, tokens, args.seq)
    gpu, profile = gpu_profile(device)
    peak_flops = profile.peak_flops[torch.bfloat16] if profile else None
    layers = f", {args.layers} layers" if args.layers else ""
    out = {"model": f"transformers LlamaForCausalLM, {args.shape} shape{layers}", "config": config.to_dict(),
           "params": sum(p.numel() for p in contenders[0].model.parameters()), "batch": args.batch, "seq": args.seq, "precision": args.precision,
           "tokens_per_step": tokens, "training_flops_per_step": flops, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "peak_bf16_flops": peak_flops, "measured_matmul_bf16_flops": matmul_rate(device),
           "warmup": args.warmup, "steps": args.steps, "contenders": {}}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    eager = next((c for c in contenders if c.name == "eager" and not c.error), None)
    for c in contenders:
        if c.error or not c.times:
            out["contenders"][c.name] = {"error": c.error or "no timed step"}
            continue
        step = statistics.median(c.times)
        out["contenders"][c.name] = {
            "median_step_seconds": step, "step_seconds": c.times, "tokens_per_second": tokens / step,
            "mfu": flops / step / peak_flops if peak_flops else None, "peak_bytes": c.peak, "losses": c.losses,
            "loss_vs_eager": max(abs(a / b - 1) for a, b in zip(c.losses, eager.losses)) if eager else None}
    out["planner"] = planner_prediction(config, args, gpu) if args.planner else {"error": "not asked (--no-planner)"}
    return out


def table(r: dict) -> str:
    rows = [["contender", "step ms", "tokens/s", "MFU", "peak GiB", "vs torch.compile", "loss vs eager"]]
    ref, failed = r["contenders"].get("torch.compile", {}), []
    for name, c in r["contenders"].items():
        if "error" in c:
            failed.append(f"{name} failed: {c['error'][:300]}")
            continue
        ratio = f"{c['median_step_seconds'] / ref['median_step_seconds']:.2f}x time" if "median_step_seconds" in ref else "-"
        if ref.get("peak_bytes") and c["peak_bytes"]:
            ratio += f", {c['peak_bytes'] / ref['peak_bytes']:.2f}x peak"
        peak = f"{c['peak_bytes'] / 2**30:.2f}" if c["peak_bytes"] else "-"
        rows.append([name, f"{c['median_step_seconds'] * 1e3:.1f}", f"{c['tokens_per_second']:,.0f}",
                     f"{c['mfu']:.1%}" if c["mfu"] is not None else "-", peak, ratio,
                     f"{c['loss_vs_eager']:.1e}" if c["loss_vs_eager"] is not None else "-"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    matmul = r["measured_matmul_bf16_flops"]
    head = (f"{r['model']}: {r['params'] / 1e9:.2f}B params, {r['precision']} precision; batch {r['batch']} x seq {r['seq']}; {r['device_name']}, "
            f"torch {r['torch']}, triton {r['triton']}; {r['date']}; medians of {r['steps']} interleaved rounds\n"
            f"MFU against {r['peak_bf16_flops'] or 0:.3g} FLOP/s dense bf16 "
            f"(an 8192^3 bf16 matmul measured {matmul or 0:.3g}); {r['training_flops_per_step']:.3g} FLOPs per step")
    plan, picofx_run = r["planner"], r["contenders"].get("picofx", {})
    if "error" in plan:
        tail = f"planner: {plan['error']}"
    else:
        tail = (f"planner ({plan['layout']}): predicted {plan['step_seconds'] * 1e3:.1f} ms, "
                f"{plan['memory_bytes'] / 2**30:.2f} GiB")
        if "median_step_seconds" in picofx_run:
            tail += (f"; picofx measured {picofx_run['median_step_seconds'] * 1e3:.1f} ms "
                     f"({plan['step_seconds'] / picofx_run['median_step_seconds'] - 1:+.0%}), "
                     f"{picofx_run['peak_bytes'] / 2**30:.2f} GiB "
                     f"({plan['memory_bytes'] / picofx_run['peak_bytes'] - 1:+.0%})")
    return head + "\n" + "\n".join(lines + failed) + "\n" + tail


def main(argv=None):
    args = parse_args(argv)
    if args.profile:  # kernels named after the graph nodes they fuse, so the trace maps back to the graph
        from torch._inductor import config as inductor_config

        inductor_config.triton.descriptive_names = inductor_config.cpp.descriptive_names = "inductor_node"
    r = run(args)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from results import write_json  # tools/results.py

    write_json(r, args.json, "bench_gpu.json")
    print(table(r))
    if r.get("profile"):
        from picofx.runtime.attribution import table as profile_table

        print(profile_table(r["profile"]))
    return r


if __name__ == "__main__":
    main()
