"""picofx train's throughput arithmetic: FLOPs per token and MFU for every layout; the per-step
metrics written by --metrics and --tensorboard.

MFU = the whole model's FLOPs per token x the tokens per second of the whole run (every replica)
/ (the peak FLOP/s of one rank x every rank the run uses: dp x tp x pp x cp), the layout being the
run's one description (picofx.planner.layouts.Layout). A pipeline's stages and
a replica's tensor-parallel ranks share one batch, so the run's tokens/s is one replica's tokens/s
times the data-parallel replicas; the FLOPs per token stay the whole model's, whatever part of it
a rank holds. The peak is measured on a CPU (a matmul at the step's dtype, on the threads each
rank runs with, every rank at once) and a GPU's datasheet figure.
"""
from __future__ import annotations

import collections
import json
import math
import pathlib
from dataclasses import dataclass

import torch

from picofx.runtime.peaks import cached_cpu_peak
from picofx.cost.device import available_cores, device_for, matmul_flops
from picofx.cost.model import CostModel, compute_dtype, node_flops
from picofx.diagnose import gather_rank_figures
from picofx.diagnose.records import METRICS_NAME
from picofx.planner.layouts import Layout

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def run_tokens_per_s(replica_tokens_per_s: float, layout: Layout) -> float:
    """Tokens per second of the whole run from one replica's (one process, or one pipeline)."""
    return replica_tokens_per_s * layout.dp


def model_flops_utilization(flops_per_token: float, replica_tokens_per_s: float, peak_flops_per_s: float,
                            layout: Layout) -> float:
    """The fraction of the ranks' peak that the model's FLOPs use (0.42 is 42%)."""
    return flops_per_token * run_tokens_per_s(replica_tokens_per_s, layout) / (peak_flops_per_s * layout.gpus)


def matmul_parameters(model: torch.nn.Module) -> int:
    """Parameters that multiply activations: every 2-D or larger weight of a module other than an
    embedding, each counted once. An embedding's rows are looked up, not multiplied, unless its
    weight is also an output projection's (tied), whose matmul it then counts as."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        for p in module.parameters(recurse=False):
            if p.dim() >= 2:
                seen[id(p)] = p.numel()
    return sum(seen.values())


def palm_flops_per_token(model: torch.nn.Module, seq: int) -> float:
    """The PaLM convention: 6 x matmul parameters + 12 x layers x hidden x seq (attention's)."""
    config = model.config
    return 6 * matmul_parameters(model) + 12 * config.num_hidden_layers * config.hidden_size * seq


def step_dtype(graphs) -> torch.dtype:
    """The dtype most of the step's FLOPs are computed in (bf16 under the precision pass)."""
    flops: collections.Counter = collections.Counter()
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op == "call_function":
                flops[compute_dtype(node)] += node_flops(node)
    return max(flops, key=flops.get) if flops else torch.float32


def captured_graphs(opt_model) -> list:
    """The forward and backward graphs this rank runs: the model's, or each of its pipeline stages'."""
    sets = opt_model.pipeline.stage_graphs.values() if opt_model.pipeline is not None else [opt_model.graphs]
    return [g for graphs in sets for g in (graphs["forward"], graphs["backward"])]


def captured_flops_per_token(rank_flops: float, tokens_per_call: int, layout: Layout, total=None) -> float:
    """The whole model's FLOPs per token as the captured graphs hold them. `rank_flops`: one call of
    this rank's graphs (its stages on one micro-batch of `tokens_per_call` tokens under a pipeline);
    `total(x)` sums x over all ranks (an all-reduce) where the model is split over them (a
    tensor-parallel rank's graphs hold its piece of each matmul, and the norms whole; a context-parallel
    rank's, its part of each sequence)."""
    if layout.pp == 1 and layout.tp == 1 and layout.cp == 1:
        return rank_flops / tokens_per_call
    return total(rank_flops) / layout.dp / tokens_per_call


@dataclass(frozen=True)
class Peak:
    """The FLOP/s of one rank that MFU divides by, and where the figure comes from."""

    flops: float
    dtype: torch.dtype
    kind: str  # "measured" (a CPU's), "datasheet" (a GPU's) or "nominal"
    how: str   # what was measured, or the device the figure is for
    when: str = ""  # a measured peak's: when it was measured (once per machine, then read from the cache)


MATMUL = 1024  # the measured matmul's size: 2 GFLOP, a few tens of ms on one core


def rank_peak(device: str, dtype: torch.dtype, layout: Layout, total=None) -> Peak:
    """One rank's peak in `dtype`: a GPU's datasheet figure; on a CPU, what a matmul reaches on the
    threads the run uses, measured on every rank at once (they share the machine as the run did)
    and averaged, so every rank must call it."""
    if torch.device(device).type == "cuda":
        spec = device_for(device)
        return Peak(spec.flops_per_second(dtype), dtype, spec.source, spec.name)
    threads = torch.get_num_threads()
    flops, when = cached_cpu_peak(lambda: matmul_flops(dtype, device, size=MATMUL, repeats=3), dtype, threads,
                                  layout.gpus, total)
    per_rank = " per rank, every rank at once" if layout.gpus > 1 else ""
    return Peak(flops, dtype, "measured", f"a {MATMUL} x {MATMUL} matmul on {threads} thread"
                                          f"{'s' if threads > 1 else ''}{per_rank}", when)


def oversubscribed(local_ranks: int, threads: int, cores: int | None = None) -> str | None:
    """A warning when the ranks on this machine run more threads than it has cores, else None."""
    cores = cores or available_cores()
    if local_ranks * threads <= cores:
        return None
    ranks = f"{local_ranks} ranks x {threads} threads" if local_ranks > 1 else f"{threads} threads"
    fix = f"set OMP_NUM_THREADS={cores // local_ranks}" if local_ranks <= cores else f"run at most {cores} ranks here"
    return (f"{ranks} is more than the {cores} cores this machine gives the run: the threads take turns and "
            f"every step slows, many times over on a busy machine; {fix}")


@dataclass(frozen=True)
class Throughput:
    mfu: float                    # a fraction of the ranks' peak
    palm_flops_per_token: float   # 6N + 12LHT, the whole model's
    graph_flops_per_token: float  # what the captured graphs of every rank hold, the whole model's
    peak: Peak                    # of one rank

    def line(self, layout: Layout) -> str:
        ranks = f" per rank x {layout.gpus} ranks" if layout.gpus > 1 else ""
        dtype = DTYPE_NAMES.get(self.peak.dtype, str(self.peak.dtype))
        return (f"MFU {100 * self.mfu:.3g}% of the {self.peak.kind} {dtype} peak, {self.peak.flops / 1e9:,.0f} "
                f"GFLOP/s{ranks} ({self.peak.how}){' ' + self.peak.when if self.peak.when else ''}; "
                f"{self.palm_flops_per_token / 1e6:.2f} MFLOP/token by "
                f"6N+12LHT, {self.graph_flops_per_token / 1e6:.2f} MFLOP/token in the captured graphs")


def throughput(model, opt_model, replica_tokens_per_s: float, *, seq: int, tokens_per_call: int, device: str,
               layout: Layout, total=None, peak=rank_peak) -> Throughput:
    """MFU against the peak, on every rank, of the dtype the step computes in; the FLOPs per token by
    the PaLM convention and as the captured graphs hold them. Every rank calls it (`total`, the
    sum over the ranks, is a collective). `peak(device, dtype, layout, total)`: one rank's Peak."""
    graphs = captured_graphs(opt_model)
    dtype = step_dtype(graphs)
    palm = palm_flops_per_token(model, seq)
    cost = CostModel(device_for(device))
    graph_per_token = captured_flops_per_token(sum(cost.graph_flops(g) for g in graphs), tokens_per_call,
                                               layout, total)
    rank = peak(device, dtype, layout, total)
    mfu = model_flops_utilization(palm, replica_tokens_per_s, rank.flops, layout)
    return Throughput(mfu, palm, graph_per_token, rank)


def peak_memory_bytes(device: str) -> int:
    """A GPU's peak of allocated bytes since the last reset (each step resets it); on a CPU, which
    has no allocator statistics, the process's peak resident set (it never falls)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class StepMetrics:
    """--metrics FILE (one JSON line per step) and --tensorboard DIR (the same scalars): each step's
    loss, learning rate, gradient norm (before clipping), tokens/s of the whole run (every replica),
    MFU and peak memory. Every rank makes it (the peak MFU divides by is measured on all at once);
    the rank that `speaks` writes."""

    def __init__(self, *, path: str | None, tensorboard: str | None, flops_per_token: float, peak: Peak,
                 layout: Layout, device: str, speaks: bool, append: bool, run: dict | None = None):
        self.flops_per_token, self.peak, self.layout, self.device = flops_per_token, peak, layout, device
        self.run = run or {}  # the run's own figures in every line, for picofx doctor (batch, data workers, device)
        self.gathers = path is not None  # the same on every rank: each rank's times go into rank 0's lines
        self.file = self.board = None
        if speaks and path is not None:
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a" if append else "w")
        if speaks and tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(tensorboard)
        if torch.device(device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @classmethod
    def of_run(cls, args, layout: Layout, model, opt_model, *, speaks: bool, append: bool,
               total=None) -> StepMetrics | None:
        """The run's writer, or None without --metrics, --tensorboard and --save (whose directory then
        holds the records, for picofx doctor). A collective under torchrun."""
        path = args.metrics or (str(pathlib.Path(args.save) / METRICS_NAME) if args.save else None)
        if path is None and args.tensorboard is None:
            return None
        peak = rank_peak(args.device, step_dtype(captured_graphs(opt_model)), layout, total)
        run = {"batch": args.batch, "data_workers": args.data_workers, "device": args.device}
        if torch.device(args.device).type == "cuda":
            run["memory_capacity_bytes"] = torch.cuda.get_device_properties(args.device).total_memory
        return cls(path=path, tensorboard=args.tensorboard,
                   flops_per_token=palm_flops_per_token(model, args.seq), peak=peak, layout=layout,
                   device=args.device, speaks=speaks, append=append, run=run)

    def write(self, step: int, *, loss: float, lr: float, grad_norm: float, tokens: int, seconds: float,
              data_s: float = 0.0, cpu_s: float = float("nan")) -> dict:
        """One step's line (`tokens`: this replica's batch, in `seconds`, `data_s` of them waiting for
        it, `cpu_s` the process's CPU time). Under torchrun every rank calls it: rank 0's line holds
        every rank's times (`ranks`, one gather; picofx.diagnose names a slow rank from them)."""
        timing = {"step_s": seconds, "data_s": data_s, "cpu_s": cpu_s}
        ranks = gather_rank_figures(timing) if self.gathers else None
        replica_tokens_per_s = tokens / seconds
        entry = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                 "tokens_per_s": run_tokens_per_s(replica_tokens_per_s, self.layout),
                 "mfu": model_flops_utilization(self.flops_per_token, replica_tokens_per_s, self.peak.flops,
                                                self.layout),
                 "peak_memory_bytes": peak_memory_bytes(self.device), **timing, **self.run}
        if ranks is not None:
            entry["ranks"] = ranks
        if torch.device(self.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.file is not None:
            plain = {k: v if not isinstance(v, float) or math.isfinite(v) else None  # JSON has no NaN
                     for k, v in entry.items()}
            self.file.write(json.dumps(plain) + "\n")
            self.file.flush()
        if self.board is not None:
            for key, value in entry.items():
                if key != "step" and key not in self.run and isinstance(value, (int, float)):
                    self.board.add_scalar(f"train/{key}", value, step)
        return entry

    def close(self) -> None:
        for sink in (self.file, self.board):
            if sink is not None:
                sink.close()
