"""picofx train's throughput arithmetic: FLOPs per token and MFU for every layout.

MFU = the whole model's FLOPs per token x the tokens per second of the whole run (every replica)
/ (the peak FLOP/s of one rank x the number of ranks). A pipeline's ranks share one batch, so
the run's tokens/s is one pipeline's tokens/s times the data-parallel replicas; the FLOPs per
token stay the whole model's, whatever part of it a rank holds.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from picofx.cost.device import device_for
from picofx.cost.model import CostModel, compute_dtype, node_flops

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Layout:
    dp: int = 1  # data-parallel replicas, each on its own batch
    pp: int = 1  # pipeline stages, one batch through all of them

    @property
    def ranks(self) -> int:
        return self.dp * self.pp


def run_tokens_per_s(replica_tokens_per_s: float, layout: Layout) -> float:
    """Tokens per second of the whole run from one replica's (one process, or one pipeline)."""
    return replica_tokens_per_s * layout.dp


def model_flops_utilization(flops_per_token: float, replica_tokens_per_s: float, peak_flops_per_s: float,
                            layout: Layout) -> float:
    """The fraction of the ranks' peak that the model's FLOPs use (0.42 is 42%)."""
    return flops_per_token * run_tokens_per_s(replica_tokens_per_s, layout) / (peak_flops_per_s * layout.ranks)


def palm_flops_per_token(model: torch.nn.Module, seq: int) -> float:
    """The PaLM convention: 6 x matmul parameters + 12 x layers x hidden x seq, embedding excluded."""
    config = model.config
    matmul_params = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embedding" not in name)
    return 6 * matmul_params + 12 * config.num_hidden_layers * config.hidden_size * seq


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
    `total(x)` sums x over all ranks (an all-reduce) where the model is split over them."""
    if layout.pp == 1:
        return rank_flops / tokens_per_call
    return total(rank_flops) / layout.dp / tokens_per_call


@dataclass(frozen=True)
class Throughput:
    mfu: float                    # a fraction of the ranks' peak
    palm_flops_per_token: float   # 6N + 12LHT, the whole model's
    graph_flops_per_token: float  # what the captured graphs of every rank hold, the whole model's
    peak: float                   # FLOP/s of one rank in `dtype`
    dtype: torch.dtype
    device_name: str
    source: str

    def line(self, layout: Layout) -> str:
        ranks = f"{layout.ranks} ranks' " if layout.ranks > 1 else "its "
        return (f"MFU {100 * self.mfu:.3g}% of {ranks}{DTYPE_NAMES.get(self.dtype, str(self.dtype))} peak on "
                f"{self.device_name} ({self.peak / 1e9:,.0f} GFLOP/s{' each' if layout.ranks > 1 else ''}, "
                f"{self.source}); {self.palm_flops_per_token / 1e6:.2f} MFLOP/token by 6N+12LHT, "
                f"{self.graph_flops_per_token / 1e6:.2f} MFLOP/token in the captured graphs")


def throughput(model, opt_model, replica_tokens_per_s: float, *, seq: int, tokens_per_call: int, device: str,
               layout: Layout, total=None) -> Throughput:
    """MFU against the peak, on every rank, of the dtype the step computes in; the FLOPs per token by
    the PaLM convention and as the captured graphs hold them."""
    graphs = captured_graphs(opt_model)
    spec = device_for(device)
    dtype = step_dtype(graphs)
    peak = spec.flops_per_second(dtype)
    palm = palm_flops_per_token(model, seq)
    cost = CostModel(spec)
    graph_per_token = captured_flops_per_token(sum(cost.graph_flops(g) for g in graphs), tokens_per_call,
                                               layout, total)
    mfu = model_flops_utilization(palm, replica_tokens_per_s, peak, layout)
    return Throughput(mfu, palm, graph_per_token, peak, dtype, spec.name, spec.source)
