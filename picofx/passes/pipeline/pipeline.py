"""Pass `pipeline`: cut the captured forward graph into pipeline stages balanced by predicted cost.

Forward stage; it returns one graph per stage (`PassResult.graphs`), which picofx's pipeline
runtime (`picofx.runtime.pipeline`) compiles and runs as `torch.distributed.pipelining` stages.

1. The graph's step is the loss alone (other outputs, such as logits, are dropped). Nodes that
   depend on no user input (casts of weights, RoPE tables, masks) are copied into every stage
   that reads them instead of being sent between stages.
2. The other nodes, in graph order, form a chain of units, split where exactly one
   floating-point activation crosses (the residual stream between and inside decoder layers),
   and at the places `balance` asks for. Each unit gets its forward + backward time from the
   cost model (`CostModel.training_time`), or with `measure=True` from running one micro-batch
   with a clock at every unit boundary (`picofx.runtime.unit_clock`: the first rank measures,
   every rank cuts by its figures); its parameters' bytes and its activations' bytes.
3. `balance="cost"`: `picofx.cost.balance.balanced_cuts` (min over cuts of the slowest stage,
   memory within the device); "layers": equal numbers of the model's repeated layers per stage
   (the embedding goes with the first, the final norm, projection and loss with the last); a list
   of module paths: stages begin where those modules begin.
4. `torch.fx.passes.split_module` cuts the graph; each stage graph takes its parameters, buffers
   and constants (the captured inputs' slots) and the values the previous stage sends (user
   inputs a later stage reads travel along), and returns what later stages read (the last: the loss).
   A parameter read by several stages (tied weights) is an input of each; the layout lists it,
   and the runtime sums its gradient between them.
5. Under sequence parallelism (pass tensor_parallel, which runs on each stage graph) a later stage
   receives the residual stream as its tensor-parallel rank's sequence shard, as the stage before
   leaves it: `picofx.parallel.stage_inputs.received_sequence_shards` says which inputs those are and sizes them, so each rank
   sends 1/tp of the activation and its gradient instead of gathering it at every cut.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.fx.passes.split_module import split_module

from picofx.capture.vocabulary import SIGNATURE_META, input_kind, input_slot
from picofx.cost.balance import (INTERLEAVED_SCHEDULES, SINGLE_STAGE_SCHEDULES, balanced_cuts, microbatch_refusal,
                                 plan_for)
from picofx.cost.chain import chain_units, layer_bounds, path_bounds, state_per_parameter_byte
from picofx.cost.model import CostModel
from picofx.manager import Context, PassInfo, PassResult, Stage, register_pass
from picofx.manager.pass_manager import copy_graph
from picofx.parallel.layouts import PipelineLayout, StageSignature, layouts_of
from picofx.parallel.mesh import initialized, measured_on_first_rank, pipeline_dims
from picofx.runtime.unit_clock import measure_units

ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
KEY = "picofx_value"  # node.meta: the captured node a value stands for, across split_module


@register_pass("pipeline")
@dataclass(frozen=True)
class Pipeline:
    stages: int = 2
    schedule: str = "1F1B"
    microbatches: int = 4
    balance: str | tuple = "cost"   # "cost", "layers", or module paths where stages 1.. begin
    virtual: int = 1                # stages per rank (interleaved schedules)
    group: object = None            # ProcessGroup or DeviceMesh with a "pp" dimension; None: the run's mesh or world
    measure: bool = False           # time units by running one micro-batch step (whole model) on the first rank

    @property
    def info(self) -> PassInfo:
        return PassInfo(Stage.FORWARD, mesh_dims=("pp",), mesh_size=self.stages, splits_graph=True, microbatches=True,
                        measures=self.measure)

    def __post_init__(self):
        known = SINGLE_STAGE_SCHEDULES + INTERLEAVED_SCHEDULES
        if self.schedule in ZERO_BUBBLE_SCHEDULES:
            raise ValueError(f"Pipeline: schedule {self.schedule!r} splits each stage's backward into input and "
                             "weight gradients itself, which a compiled picofx stage (one autograd function) cannot "
                             f"do; use one of {known}.")
        if self.schedule not in known:
            raise ValueError(f"Pipeline: unknown schedule {self.schedule!r}; use one of {known}.")
        if self.stages < 2 or self.virtual < 1 or self.microbatches < 1:
            raise ValueError(f"Pipeline: stages >= 2, virtual >= 1, microbatches >= 1 (got stages={self.stages}, "
                             f"virtual={self.virtual}, microbatches={self.microbatches}).")
        if (self.virtual > 1) != (self.schedule in INTERLEAVED_SCHEDULES):
            raise ValueError(f"Pipeline: schedule {self.schedule!r} runs "
                             f"{'several stages' if self.schedule in INTERLEAVED_SCHEDULES else 'one stage'} per "
                             f"rank, but virtual={self.virtual}; use virtual=1 with GPipe/1F1B, virtual>=2 with "
                             f"{INTERLEAVED_SCHEDULES}.")
        refusal = microbatch_refusal(self.stages, self.microbatches, self.schedule)
        if refusal:
            raise ValueError(f"Pipeline: {refusal}; raise microbatches.")
        if isinstance(self.balance, str) and self.balance not in ("cost", "layers"):
            raise ValueError(f"Pipeline: balance is 'cost', 'layers' or a list of module paths, got {self.balance!r}.")
        if not isinstance(self.balance, str) and len(self.balance) != self.stages * self.virtual - 1:
            raise ValueError(f"Pipeline: balance lists {len(self.balance)} module paths where stages begin; "
                             f"{self.stages * self.virtual} stages need {self.stages * self.virtual - 1}.")

    @property
    def total_stages(self) -> int:
        return self.stages * self.virtual

    def capture_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The step runs in micro-batches: capture one (the first), after checking they divide the batch."""
        batch = batch_size(args, kwargs)
        if batch % self.microbatches:
            raise ValueError(f"Pipeline: {self.microbatches} micro-batches do not divide the batch of {batch} "
                             f"(dimension 0 of the inputs); use a batch that is a multiple of {self.microbatches}.")
        size = batch // self.microbatches
        return pytree.tree_map(lambda x: x[:size] if _batched(x, batch) else x, (args, kwargs))

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        work = fx.GraphModule(gm, copy_graph(gm.graph))
        work.meta.update(gm.meta)
        loss = keep_loss_only(work)
        cost_model = ctx.cost_model or CostModel(ctx.device)
        units, starts, main = chain_units(work, cost_model, self.balance)
        if self.measure:
            if ctx.device.type == "meta":
                raise ValueError("Pipeline(measure=True): the model is on the meta device, where nothing can be "
                                 "timed; use measure=False to cut by the cost model's predictions.")
            pp = pipeline_dims(self.group, ctx.mesh, self.stages).pp if initialized() else None
            times = measured_on_first_rank(lambda: measure_units(work, ctx.example_inputs, main, starts),
                                           len(units), pp)
            units = [replace(u, time=t) for u, t in zip(units, times)]
        device = cost_model.device
        link = device.intra_node_link
        plan_args = dict(schedule=self.schedule, microbatches=self.microbatches, virtual=self.virtual, link=link,
                         state_per_parameter_byte=state_per_parameter_byte(ctx.model))
        if self.balance == "cost":
            plan = balanced_cuts(units, self.total_stages, capacity=device.memory_capacity,
                                 **plan_args)
        else:
            bounds = layer_bounds(units, self.total_stages) if self.balance == "layers" else \
                path_bounds(units, list(self.balance))
            plan = plan_for(units, bounds, capacity=device.memory_capacity, **plan_args)
        stage_of = {}
        for stage in plan.stages:
            for u in stage.units:
                for node in main[starts[u]:starts[u + 1] if u + 1 < len(starts) else len(main)]:
                    stage_of[node] = stage.index
        copy_constants_into_stages(work, stage_of)
        layout = PipelineLayout(self.stages, self.virtual, self.schedule, self.microbatches, self.group, units, plan,
                                tied_parameters(work, stage_of))
        graphs = split_stages(work, stage_of, self.total_stages, loss, layout)
        slowest = max(plan.stages, key=lambda s: s.time)
        return PassResult(changed=True, graphs=graphs, notes={
            "stages": self.total_stages, "unit_times": "measured" if self.measure else "predicted",
            "cuts": " | ".join(units[c].label for c in plan.cuts),
            "slowest_stage_ms": slowest.time * 1e3, "step_ms": plan.step_time * 1e3, "bubble": plan.bubble})


def batch_size(args: tuple, kwargs: dict) -> int:
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        raise ValueError("Pipeline: the step has no tensor input with a batch dimension to split into micro-batches.")
    return tensors[0].shape[0]


def _batched(x, batch: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch


def keep_loss_only(gm: fx.GraphModule) -> fx.Node:
    """Make the graph return its loss alone (the first scalar floating-point output)."""
    signature = gm.meta[SIGNATURE_META]
    if any(kind == "buffer" for kind, _ in signature.outputs):
        raise ValueError("Pipeline: the step updates buffers; pipelined steps may only read them.")
    output = gm.graph.output_node()
    flat = pytree.tree_leaves(output.args[0])
    scalars = [n for n in flat if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)
               and n.meta["val"].dim() == 0 and n.meta["val"].is_floating_point()]
    if not scalars:
        raise ValueError("Pipeline: the step returns no scalar loss; a pipelined model must compute its loss "
                         "(pass labels, or loss_fn= to picofx.optimize).")
    output.args = ((scalars[0],),)
    gm.graph.eliminate_dead_code()
    return scalars[0]


def copy_constants_into_stages(gm: fx.GraphModule, stage_of: dict) -> None:
    """Give every node that depends on no user input (weight casts, RoPE tables, masks) the stage
    of its readers, copied once per further stage that reads it; in reverse order, so a copy's
    own inputs are placed (and copied) after it."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function" or node in stage_of:
            continue
        stages = sorted({stage_of[u] for u in node.users if u.op != "output"})
        if not stages:
            raise ValueError(f"Pipeline: {node.name} depends on no input and is returned; cannot place it.")
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        first_reader = {s: min((u for u in node.users if stage_of.get(u) == s), key=order.__getitem__)
                        for s in stages}
        stage_of[node] = stages[0]
        for s in stages[1:]:
            with gm.graph.inserting_before(first_reader[s]):  # among its stage's nodes, where split_module wants it
                twin = gm.graph.node_copy(node)
            stage_of[twin] = s
            for user in [u for u in node.users if stage_of.get(u) == s]:
                user.replace_input_with(node, twin)
        first_reader[stages[0]].prepend(node)


def tied_parameters(gm: fx.GraphModule, stage_of: dict) -> dict[str, list[int]]:
    """Parameters read by more than one stage (a tied embedding and head)."""
    tied = {}
    for node in gm.graph.nodes:
        if input_kind(node) == "parameter":
            stages = sorted({stage_of[u] for u in node.users})
            if len(stages) > 1:
                tied[input_slot(node).target] = stages
    return tied


def split_stages(gm: fx.GraphModule, stage_of: dict, num_stages: int, loss: fx.Node,
                 layout: PipelineLayout) -> list[fx.GraphModule]:
    for node in gm.graph.nodes:
        node.meta[KEY] = node.name
    parts = split_module(gm, None, lambda n: stage_of[n], keep_original_order=True)
    submods = [getattr(parts, f"submod_{k}") for k in range(num_stages)]
    reads = [[n.meta[KEY] for n in sub.graph.nodes if n.op == "placeholder"] for sub in submods]
    produced = [[a.meta[KEY] for a in pytree.tree_leaves(sub.graph.output_node().args[0]) if isinstance(a, fx.Node)]
                for sub in submods]
    slots = {n.name: input_slot(n) for n in gm.graph.nodes if n.op == "placeholder"}
    originals = {n.name: n for n in gm.graph.nodes}
    order = {name: i for i, name in enumerate(originals)}
    carried_in = [[name for name, slot in slots.items() if slot.kind == "user"]]  # the step's inputs, in order
    for k in range(1, num_stages):
        later = {name for r in reads[k:] for name in r}
        available = set(carried_in[k - 1]) | set(produced[k - 1])
        carried_in.append(sorted(available & later, key=order.__getitem__))
    graphs = []
    for k, sub in enumerate(submods):
        outputs = carried_in[k + 1] if k + 1 < num_stages else [loss.name]
        graphs.append(stage_graph(sub, k, num_stages, slots, carried_in[k], outputs, layout, originals))
    return graphs


def stage_graph(sub: fx.GraphModule, index: int, num_stages: int, slots: dict, carried: list[str],
                outputs: list[str], layout: PipelineLayout, originals: dict) -> fx.GraphModule:
    """Stage `index` as a flat graph: (its parameters, buffers, constants, then the carried values)
    -> the values later stages read."""
    graph = fx.Graph()
    env, by_key = {}, {}
    sub_inputs = {n.meta[KEY]: n for n in sub.graph.nodes if n.op == "placeholder"}
    resident = [name for name in slots if slots[name].kind != "user" and name in sub_inputs]
    for name in resident + carried:
        node = graph.placeholder(name)
        node.meta = copy.copy(originals[name].meta)
        by_key[name] = node
        if name in sub_inputs:
            env[sub_inputs[name]] = node
    for node in sub.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        env[node] = graph.node_copy(node, lambda a: env[a])
        by_key.setdefault(node.meta[KEY], env[node])
    graph.output(tuple(by_key[name] for name in outputs))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    layouts_of(gm).stage = StageSignature(index, num_stages, [slots[n] for n in resident] + list(carried),
                                          list(outputs))
    layouts_of(gm).pipeline = layout
    return gm
