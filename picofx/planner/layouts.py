"""Layouts of a training run over N GPUs (dp x tp x pp, sharded or replicated, micro-batches,
checkpointing, sequence parallelism, compression), each predicted: memory per GPU, step time and
what limits it (what to change: picofx.planner.suggest).

Ranks are laid out as picofx's mesh lays them out (pp outermost, then data parallel, tp
innermost), so a tp group stays within a node. Formulas, per micro-batch of b sequences of T tokens:
- compute: the captured layer's and the rest's predicted seconds x b / tp on the slowest pipeline
  rank, the head on the last (`picofx.planner.pipeline`); checkpointing adds one more forward of the layers;
- tensor parallel: 4 ring all-reduces per layer of b x T x hidden bf16 activations (the same bytes
  as all-gather + reduce-scatter under sequence parallelism), one more for the head's input gradient
  and one for the embedding's output, and the vocabulary-parallel loss's three of b x T fp32 numbers;
  not overlapped; full checkpointing's recompute runs each layer's two again; each rank's matmuls
  at their split shapes (`picofx.planner.tensor_parallel`);
- pipeline: (m + (pp - 1) / v) micro-batch slots for m micro-batches, v stages per rank (1F1B and
  GPipe: v = 1; interleaved 1F1B: `virtual_stages`): the bubble is (pp - 1) / v of them; each slot
  sends its activations on and receives their gradient back v times, a link latency and
  b x T x hidden bf16 bytes each (/ tp under sequence parallelism, or where the run scatters its
  sends over tp), not overlapped, on the sending rank's own network port across nodes;
- replicated data parallel: the stage's gradients exchanged as `compress` says (none: a ring
  all-reduce of fp32; the bytes each compressor sends: `picofx.planner.compress`), hidden behind the
  last micro-batch's backward as far as it lasts (not at all on CPU ranks sharing cores), plus the
  compressor's own passes over the gradient; across nodes a group gets the network ports of the
  ranks it has in each node (beside tp 8, one of eight);
- sharded, by `shard_stage` (`picofx.planner.sharding`): stage 3 per micro-batch each layer's (and
  the embedding's and head's) bf16 gather (twice: forward, backward) and fp32 reduce-scatter; stage 2
  one gather a step, the parameters kept across micro-batches, a reduce-scatter per micro-batch
  running on behind the next micro-batches; stage 1 one reduce-scatter and one gather a step;
  overlapped layer by layer (not at all on CPU ranks sharing cores);
- memory: 16 bytes per parameter of the stage (sharded: as its stage keeps them); activations of the micro-batches
  in flight (1F1B: pp on the first stage), divided by tp as Megatron's formula does (all of them
  with sequence parallelism; 24 of each layer's 34 units without); the gathered layers when sharded;
- float8 (precision float8: torchao's tensorwise recipe, gathering weights in float8 when sharded;
  float8_rowwise: gathering bf16): a layer's linears that pay run at the device's float8 rate with
  their casts, the head in bf16 (`picofx.planner.float8`); refused where the device has no float8 rate;
- context parallel (cp > 1, where the sequence is long): compute and activations per rank / cp, each
  layer's K/V all-gather and gradient reduce-scatter, gradients summed over dp x cp
  (`picofx.planner.context`).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import torch

from picofx.cost.balance import SINGLE_STAGE_SCHEDULES, in_flight as in_flight_micro_batches
from picofx.cost.comm import all_gather_seconds, all_reduce_seconds, reduce_scatter_seconds, send_seconds
from picofx.cost.device import MAX_MEMORY_FRACTION, Device
from picofx.cost.shard import ADAMW_STATE_BYTES, Layer
from picofx.planner.context import cp_refusal, gathered_kv_kept, kv_exchange_seconds
from picofx.planner.compress import exchange as gradient_exchange, scatter_exchange
from picofx.planner.costs import ModelCosts
from picofx.planner.pipeline import busiest_rank, pipeline_refusal, pipeline_slots
from picofx.planner.float8 import at_precision, gather_bytes_per_parameter, refusal as float8_refusal
from picofx.planner.recipe import refusal
from picofx.planner.sharding import RESHARD_AFTER_FORWARD, sharded_step
from picofx.planner.tensor_parallel import RECOMPUTED_ALL_REDUCES, split_layer_costs

TP_SPLIT_FRACTION = 24 / 34  # Megatron's count: of a layer's 34 activation units per token, 24 split by tp
ADAMW_TRAFFIC = 28            # bytes an AdamW step moves per fp32 parameter: reads p, g, m, v; writes p, m, v
BOTTLENECKS = {  # the step's time terms, as the bottleneck each names
    "compute": "compute", "recompute": "recompute", "tensor_parallel_comm": "tensor-parallel communication",
    "pipeline_sends": "pipeline activation sends", "bubble": "pipeline bubble",
    "data_parallel_exposed": "exposed dp communication", "compression": "gradient compression",
    "optimizer": "optimizer step", "context_parallel_comm": "context-parallel K/V communication",
}
DOES_NOT_FIT = "memory: does not fit"


class Checkpointing(enum.StrEnum):
    """What a layout recomputes in the backward: nothing, the cheap ops of each layer (selective:
    the matmul outputs kept), or each layer whole from its input (full)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    def __bool__(self) -> bool:  # `if layout.checkpoint:` reads "recomputes anything"
        return self is not Checkpointing.NONE

    @classmethod
    def of(cls, value) -> Checkpointing:
        """From a member, its name ("none", "selective", "full") or a bool (True: full; the old spelling)."""
        if isinstance(value, bool):
            return cls.FULL if value else cls.NONE
        try:
            return cls(value.lower() if isinstance(value, str) else value)
        except ValueError:
            raise ValueError(f"checkpoint {value!r}: one of {', '.join(c.value for c in cls)} "
                             "(or true/false for full/none)") from None


CHECKPOINTS = tuple(Checkpointing)  # what layouts are planned with: none, selective, full
PRECISIONS = ("bf16", "float8", "float8_rowwise")  # float8: torchao's tensorwise recipe
CP_METHODS = ("allgather", "ring")
INTERLEAVED = "Interleaved1F1B"
SHARD_STAGES = (1, 2, 3)


@dataclass(frozen=True, init=False)
class Layout:
    """The one description of a run's layout: the planner plans it, the recipe (picofx.planner.recipe)
    turns it into passes and a mesh, `picofx train` runs it, its metrics and checkpoints record it.

    The data-parallel ranks are `dp_replicate` replicas of `dp_shard` ranks that shard (HSDP where
    both are over 1); `dp` (their product: the batches a step takes) and `shard` are what
    `Layout(dp=4, shard=True)` and `--layout dp=4,shard=true` spell. `shard` with dp_shard 1 shards over
    the cp ranks alone. Positionally: LAYOUT_NAMES' order, up to shard_stage."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    shard: bool
    microbatches: int
    schedule: str
    checkpoint: Checkpointing
    sequence_parallel: bool
    compress: str | None
    cp: int  # context-parallel ranks: each sequence split over them (picofx.planner.context)
    precision: str  # one of PRECISIONS: the matmuls' precision
    shard_stage: int  # with shard: 1 optimizer state, 2 and gradients, 3 and parameters (ZeRO's stages)
    async_tp: bool  # with sequence_parallel: its gathers and reduce-scatters chunked, overlapped with the linears
    cp_method: str  # with cp: "allgather" (each rank gathers the keys and values) or "ring"
    virtual_stages: int  # pipeline stages per rank: more than 1 runs interleaved 1F1B

    def __init__(self, dp: int | None = None, tp: int = 1, pp: int = 1, shard: bool = False, microbatches: int = 1,
                 schedule: str = "1F1B", checkpoint=Checkpointing.NONE, sequence_parallel: bool = False,
                 compress: str | None = None, cp: int = 1, precision: str = "bf16", shard_stage: int = 3, *,
                 dp_replicate: int = 1, dp_shard: int = 1, async_tp: bool = True, cp_method: str = "allgather",
                 virtual_stages: int = 1):
        if dp is not None:  # the data-parallel degree: HSDP's replicas kept where they still divide it
            replicas = dp_replicate if shard and dp_replicate < dp and dp % dp_replicate == 0 else 1
            dp_replicate, dp_shard = (replicas, dp // replicas) if shard else (dp, 1)
        elif shard and dp_shard == 1 and dp_replicate > 1:  # shard turned on: the replicas become the shards
            dp_replicate, dp_shard = 1, dp_replicate
        elif not shard and dp_shard > 1:  # shard turned off: the shards become replicas
            dp_replicate, dp_shard = dp_replicate * dp_shard, 1
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
        if shard_stage not in (1, 2, 3):
            raise ValueError(f"shard_stage {shard_stage!r}: 1, 2 or 3")
        if cp_method not in CP_METHODS:
            raise ValueError(f"cp_method {cp_method!r}: one of {', '.join(CP_METHODS)}")
        if virtual_stages > 1 and schedule in SINGLE_STAGE_SCHEDULES:  # chunks per rank: interleaved
            schedule = INTERLEAVED
        if schedule == INTERLEAVED and virtual_stages == 1:  # the interleaved schedule named alone
            virtual_stages = 2
        values = dict(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, shard=bool(shard),
                      microbatches=microbatches, schedule=schedule, checkpoint=Checkpointing.of(checkpoint),
                      sequence_parallel=bool(sequence_parallel), compress=compress, cp=cp, precision=precision,
                      shard_stage=shard_stage, async_tp=bool(async_tp), cp_method=cp_method,
                      virtual_stages=virtual_stages)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each takes its own batch (replicated, sharded, or both)."""
        return self.dp_replicate * self.dp_shard

    @property
    def virtual(self) -> int:
        """Pipeline stages per pp rank (virtual_stages)."""
        return self.virtual_stages

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def describe(self) -> str:
        stage = "" if self.shard_stage == 3 else f" stage {self.shard_stage}"
        hsdp = f" ({self.dp_replicate} replicas of {self.dp_shard})" if self.shard and self.dp_replicate > 1 else ""
        parts = [f"dp{self.dp}" + (" shard" + stage + hsdp if self.shard else ""),
                 f"tp{self.tp}" + (" sp" if self.sequence_parallel else ""), f"pp{self.pp}"]
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        ckpt = {Checkpointing.NONE: "", Checkpointing.SELECTIVE: ", selective ckpt", Checkpointing.FULL: ", ckpt"}
        chunks = f" ({self.virtual_stages} stages/rank)" if self.virtual_stages > 1 else ""
        return " x ".join(parts) + chunks + f", {self.microbatches} mb" + ckpt[self.checkpoint] + \
            (f", {self.compress}" if self.compress else "") + \
            (f", {self.precision}" if self.precision != "bf16" else "")


# what a plan's limits and --layout name: the constructor's positional order, then the keywords
LAYOUT_NAMES = ("dp", "tp", "pp", "shard", "microbatches", "schedule", "checkpoint", "sequence_parallel", "compress",
                "cp", "precision", "shard_stage", "dp_replicate", "dp_shard", "async_tp", "cp_method", "virtual_stages")


@dataclass
class Prediction:
    layout: Layout
    memory_per_gpu: int
    memory: dict
    step_s: float
    time: dict
    tokens_per_s: float
    mfu: float
    fits: bool
    reason: str = ""
    bottleneck: str = ""
    suggestions: list = field(default_factory=list)  # picofx.planner.suggest.Suggestion, best first
    measured_step_s: float | None = None
    matmuls: dict = field(default_factory=dict)  # float8 layouts: what each of a layer's linears runs in, and why

    def as_json(self) -> dict:  # the layout's fields, and dp: their data-parallel product
        return {**dataclasses.asdict(self.layout), "dp": self.layout.dp, "memory_per_gpu": self.memory_per_gpu,
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "fits": self.fits,
                "reason": self.reason, "bottleneck": self.bottleneck,
                "suggestions": [dataclasses.asdict(s) for s in self.suggestions],
                "memory": self.memory, "time": self.time, "measured_step_s": self.measured_step_s,
                "matmuls": self.matmuls}


@dataclass(frozen=True)
class Run:
    """What the plans are for: the model's costs, the machine and the batch."""

    costs: ModelCosts
    device: Device
    gpus: int
    gpus_per_node: int
    global_batch: int
    # each tp rank sends 1/tp of a stage's output and the next stage gathers it (Megatron's scatter and
    # gather); picofx's ranks send it whole unless sequence parallelism has split it already
    sends_scattered: bool = False
    even_stages: bool = False  # Megatron's cut: L / pp layers a stage, the head beside the last's (picofx.planner.pipeline)

    def link(self, ranks_spanned: int, stride: int = 1):
        """What a group of every `stride`-th rank over `ranks_spanned` consecutive ones is bound by:
        NVLink within a node; across nodes, the network ports of the ranks it has in each node (a
        data-parallel group beside tp 8 has one rank in each, so one port of eight)."""
        if ranks_spanned <= self.gpus_per_node:
            return self.device.intra_node_link
        return self.device.network_link(max(1, self.gpus_per_node // stride))


def predict(run: Run, layout: Layout) -> Prediction:
    c, L = split_layer_costs(run.costs, run.device, layout.tp), run.costs.layers
    b = run.global_batch // (layout.dp * layout.microbatches)  # sequences per micro-batch
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    share = b / cp  # the sequences' worth of tokens a rank computes: its 1/cp of each
    c, matmuls = at_precision(c, run.device, layout, int(share * c.seq))  # float8: picofx.planner.float8
    layer_s = c.layer_forward_s + c.layer_backward_s + c.recompute_s(layout.checkpoint)
    rank = busiest_rank(L, pp, (c.rest_forward_s + c.rest_backward_s) / (layer_s or 1.0), run.even_stages)
    stage_layers, busy, rest = rank.most_layers, rank.layers, float(rank.with_rest)  # most: memory; busy: time
    overhead = run.device.op_overhead * (busy * c.layer_ops + rest * c.rest_ops)  # per call, whatever b is
    fw = (share * (busy * c.layer_forward_s + rest * c.rest_forward_s)  # per call too: the weights' casts
          + busy * c.layer_call_forward_s + rest * c.rest_call_forward_s) / tp + overhead / 3
    bw = (share * (busy * c.layer_backward_s + rest * c.rest_backward_s)
          + busy * c.layer_call_backward_s + rest * c.rest_call_backward_s) / tp + 2 * overhead / 3
    full = layout.checkpoint is Checkpointing.FULL
    recompute = share * busy * c.recompute_s(layout.checkpoint) / tp + (overhead / 3 if full else 0.0)
    activation_bytes = share * c.seq * c.config.hidden_size * 2
    tp_comm = 0.0
    if tp > 1:  # 4 per layer; the head's hidden-state gradient (and, with pp 1, the embedding's output)
        activations_all_reduced = (4 + (RECOMPUTED_ALL_REDUCES if full else 0)) * busy + (2 if pp == 1 else 1)
        link = run.link(tp)
        # sequence parallelism: each of them an all-gather and a reduce-scatter (the same bytes, twice the calls)
        activation_s = (all_gather_seconds(activation_bytes, tp, link)
                        + reduce_scatter_seconds(activation_bytes, tp, link) if layout.sequence_parallel
                        else all_reduce_seconds(activation_bytes, tp, link))
        tp_comm = activations_all_reduced * activation_s + \
            3 * all_reduce_seconds(share * c.seq * 4, tp, link)  # the vocabulary-parallel loss's per token
    neighbours = run.link(2 * layout.dp * cp * tp, layout.dp * cp * tp)  # the next stage's rank is as far away
    sent = activation_bytes / tp if layout.sequence_parallel or run.sends_scattered else activation_bytes
    v = layout.virtual_stages  # interleaved: each micro-batch passes every rank v times
    sends = 2 * v * send_seconds(sent, neighbours) if pp > 1 else 0.0
    cp_comm = kv_exchange_seconds(c.config, c.seq, b, busy, tp, cp, run.link(cp * tp, tp), full)
    micro = fw + bw + recompute + tp_comm + sends + cp_comm
    slots = pipeline_slots(layout.microbatches, pp, v)
    compute_step = slots * micro
    bubble = (pp - 1) * micro / v  # interleaved: the fill and drain run chunks of 1/v of a stage
    stage_params = (stage_layers * c.layer_parameters + c.embedding_parameters / min(pp, 2)) / tp
    data = layout.dp * cp  # the ranks a gradient is summed over (sharded: the shard group)
    dp_link = run.link(data * tp, tp)
    compression = 0.0
    if data == 1:
        dp_exposed, dp_what = 0.0, ""
    elif layout.shard:
        ends = 2 if pp == 1 else 1  # the embedding and the head are units of their own, gathered apart
        ends_params = c.embedding_parameters / min(pp, 2) / tp
        units = stage_layers + ends
        layers = [Layer(f"end{i}", ends_params / ends, (fw + recompute) / units, bw / units) for i in range(ends)]
        layers += [Layer(f"l{i}", (stage_params - ends_params) / stage_layers, (fw + recompute) / units, bw / units,
                         gather_bytes_per_parameter(c)) for i in range(stage_layers)]
        sent = scatter_exchange(c.config, layout, b * c.seq, run.device) if layout.compress else None
        # ranks sharing cores: as for the all-reduce below, nothing hides
        sharded = sharded_step(layout.shard_stage, layers, data, dp_link, layout.microbatches,
                               hidden=run.device.cpu_share >= 1, reshard_after_forward=RESHARD_AFTER_FORWARD,
                               reduce_bytes_per_parameter=sent.bytes_per_parameter if sent else 4,
                               step_compute_s=compute_step, float8_weights=stage_layers * c.layer_float8_weights)
        compression = layout.microbatches * sent.compute_s if sent else 0.0  # each backward reduce-scatters
        dp_exposed, dp_what = sharded.exposed_s, sharded.what
    else:
        sent = gradient_exchange(c.config, dataclasses.replace(layout, dp=data), b * c.seq, run.device, dp_link)
        all_reduce, compression = sent.link_s, sent.compute_s
        # ranks sharing cores: gloo's threads take the cores the backward would use, nothing hides
        dp_exposed = all_reduce if run.device.cpu_share < 1 else max(0.0, all_reduce - bw)
        dp_what = f"gradient exchange ({layout.compress})" if layout.compress else "gradient all-reduce"
    optimizer = ADAMW_TRAFFIC * stage_params / (data if layout.shard else 1) / run.device.memory_bandwidth
    tensor_cost = run.device.optimizer_tensor_overhead + \
        (run.device.dtensor_parameter_overhead if tp > 1 or layout.shard else 0.0)  # the parameters are DTensors
    optimizer += (stage_layers * c.layer_tensors + c.rest_tensors) * tensor_cost
    step = compute_step + dp_exposed + compression + optimizer

    states = sharded.state_bytes if layout.shard and data > 1 else ADAMW_STATE_BYTES * stage_params
    in_flight = in_flight_micro_batches(layout.schedule, 0, pp, layout.microbatches, layout.virtual_stages)
    split = 1 / tp if layout.sequence_parallel else (1 - TP_SPLIT_FRACTION) + TP_SPLIT_FRACTION / tp
    if full:  # each layer's input (split by sequence parallelism), and one layer recomputed at a time
        kept = c.saved_bytes(layout.checkpoint) / (tp if layout.sequence_parallel else 1)
        activations = in_flight * stage_layers * share * kept + share * c.layer_saved * split
    else:
        activations = in_flight * stage_layers * share * c.saved_bytes(layout.checkpoint) * split
    activations += share * (c.rest_saved + c.transient) / tp
    activations += gathered_kv_kept(c.config, c.seq, b, 1 if full else in_flight * stage_layers, tp, cp)
    gathered = sharded.gathered_bytes if layout.shard and data > 1 else 0
    memory = {"states": int(states), "activations": int(activations), "gathered": int(gathered)}
    total = sum(memory.values())
    capacity = run.device.memory_capacity * MAX_MEMORY_FRACTION
    fits = total <= capacity
    tokens_per_s = run.global_batch * c.seq / step
    peak = run.device.flops_per_second(torch.bfloat16)
    time = {"compute": compute_step - bubble - slots * (recompute + tp_comm + sends + cp_comm),
            "recompute": slots * recompute, "context_parallel_comm": slots * cp_comm,
            "tensor_parallel_comm": slots * tp_comm, "pipeline_sends": slots * sends, "bubble": bubble,
            "data_parallel_exposed": dp_exposed,
            "compression": compression, "optimizer": optimizer}
    prediction = Prediction(layout, int(total), memory, step, time, tokens_per_s,
                            c.flops_per_token * tokens_per_s / (peak * run.gpus), fits, matmuls=matmuls)
    if not fits:
        digits = 1 if round(total / 1e9, 1) != round(capacity / 1e9, 1) else 2  # 76.04 of 75.99: not "76.0 of 76.0"
        prediction.reason = (f"memory: needs {total / 1e9:.{digits}f} GB per GPU of the {capacity / 1e9:.{digits}f} GB "
                             f"usable ({MAX_MEMORY_FRACTION:.0%} of the {run.device.name}'s "
                             f"{run.device.memory_capacity / 1e9:.1f} GB; the rest kept for the allocator and "
                             "fragmentation)")
    prediction.bottleneck = bottleneck(prediction, dp_what)
    return prediction


def runs_float8(p: Prediction) -> bool:
    return any(choice.startswith("float8") for choice in p.matmuls.values())


def bottleneck(p: Prediction, dp_what: str) -> str:
    """What limits the plan: memory where it does not fit, else the largest overhead beyond compute
    where it takes more than 15% of the step, else compute."""
    if not p.fits:
        return DOES_NOT_FIT
    overheads = ("bubble", "data_parallel_exposed", "tensor_parallel_comm", "recompute", "pipeline_sends",
                 "context_parallel_comm")
    term = max(overheads, key=lambda t: p.time[t])
    if p.time[term] <= 0.15 * p.step_s:
        return BOTTLENECKS["compute"]
    return f"{BOTTLENECKS[term]} ({dp_what})" if term == "data_parallel_exposed" else BOTTLENECKS[term]


def valid(run: Run, layout: Layout) -> str | None:
    """Why `layout` cannot run at all (None: it can)."""
    config = run.costs.config
    if layout.gpus != run.gpus:
        return "the layout's product is not the number of GPUs"
    if float8_refusal(run.device, layout.precision):
        return float8_refusal(run.device, layout.precision)
    if cp_refusal(run.costs.seq, layout.cp):
        return cp_refusal(run.costs.seq, layout.cp)
    if layout.cp > 1 and layout.compress:
        return "a compressed gradient exchange beside context parallelism is not planned: drop the compressor"
    if layout.tp > run.gpus_per_node:
        return f"tp {layout.tp} spans more than a node ({run.gpus_per_node} GPUs)"
    if config.num_attention_heads % layout.tp or config.num_key_value_heads % layout.tp:
        return f"tp {layout.tp} does not divide the heads ({config.num_attention_heads}, kv {config.num_key_value_heads})"
    if run.global_batch % (layout.dp * layout.microbatches):
        return f"the global batch {run.global_batch} does not split into {layout.dp} x {layout.microbatches}"
    if pipeline_refusal(config.num_hidden_layers, layout.pp, layout.virtual_stages):
        return pipeline_refusal(config.num_hidden_layers, layout.pp, layout.virtual_stages)
    if layout.shard and layout.shard_stage < 3 and layout.compress:
        return "a compressed gradient exchange is planned with shard stage 3 only: drop the compressor or the stage"
    return refusal(layout)  # what the passes cannot run: the micro-batch rule, the composability table
