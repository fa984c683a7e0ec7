"""Run stage graphs (from pass `pipeline`) as `torch.distributed.pipelining` stages under a schedule.

Each rank compiles only its own stages (stage k runs on pipeline rank k % ranks), each through
the manager's joint and partitioned passes (`compile_graph`), and wraps each as a `StageModule`:
an nn.Module that holds the model's own parameters under their original names and runs the
compiled stage. `PipelineStep.forward_backward` splits the batch into micro-batches, runs the
schedule and returns the mean loss on every rank. The schedule's loss function divides each
micro-batch's loss by their number (so gradients already equal the full batch's mean-loss
gradients, and gradients accumulated before the step are left alone: `scale_grads=False`).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from picofx.manager import Context, pass_info
from picofx.parallel.layouts import recorded
from picofx.parallel.mesh import PipelineDims, pipeline_dims, subgroups
from picofx.runtime.compile import compile_graph
from picofx.runtime.pipeline_order import check_same_order
from picofx.runtime.placement import local_values, place, placements
from picofx.runtime.shard_stages import reduce_after


class StageModule(nn.Module):
    """One compiled stage. Parameters and buffers are the model's own objects, registered under
    their original names (so `state_dict()` has the model's keys for this stage)."""

    def __init__(self, model: nn.Module, gm: fx.GraphModule, constants: dict, mesh=None):
        super().__init__()
        self.stage = recorded(gm).stage
        self.resident = [slot for slot in self.stage.inputs if not isinstance(slot, str)]
        self.constants = constants
        self.placed = placements(gm)  # the recorded layouts that place the stage's parameters (shard, tp)
        place(self.placed, model, mesh)  # the ranks agree on each, then its parameters are placed
        for slot in self.resident:
            if slot.kind in ("parameter", "buffer"):
                register_as(self, model, slot.target, slot.kind)
        object.__setattr__(self, "run", None)

    def resident_values(self) -> list:
        values = [slot.resident_value(self, self.constants) for slot in self.resident]
        names = [slot.target if slot.kind == "parameter" else None for slot in self.resident]
        return local_values(self.placed, names, values)

    def forward(self, *carried):
        outputs = self.run(self.resident_values() + list(carried))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def register_as(holder: nn.Module, model: nn.Module, target: str, kind: str) -> None:
    """Register the model's parameter or buffer `target` ("layers.0.mlp.weight") on `holder`
    under the same dotted name, and a tied parameter under each of its names, creating empty
    containers on the way."""
    if kind == "parameter":
        for name in parameter_names(model, target):
            _register_one(holder, model, name, kind)
    else:
        _register_one(holder, model, target, kind)


def parameter_names(model: nn.Module, target: str) -> list[str]:
    """Every name the model's parameter `target` has (more than one when tied)."""
    param = model.get_parameter(target)
    return [name for name, p in model.named_parameters(remove_duplicate=False) if p is param] or [target]


def _register_one(holder: nn.Module, model: nn.Module, target: str, kind: str) -> None:
    *path, leaf = target.split(".")
    module, source = holder, model
    for part in path:
        source = getattr(source, part)
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]
    if kind == "parameter":
        module.register_parameter(leaf, getattr(source, leaf))
    else:
        module.register_buffer(leaf, getattr(source, leaf), persistent=leaf not in source._non_persistent_buffers_set)


def example_value(node_val, requires_grad: bool) -> torch.Tensor:
    """A real tensor shaped like a stage input's recorded value: zeros (valid indices for integer inputs)."""
    t = torch.zeros(node_val.shape, dtype=node_val.dtype, device=node_val.device)
    return t.requires_grad_(requires_grad and t.is_floating_point())


class PipelineStep:
    """This rank's part of a pipelined training step."""

    def __init__(self, graphs: list[fx.GraphModule], model: nn.Module, manager, ctx: Context, report, signature):
        self.layout = layout = recorded(graphs[0]).pipeline
        self.dims = pipeline_dims(layout.mesh_spec, ctx.mesh, layout.stages)
        pp = self.dims.pp
        check_same_cuts(layout, pp.group)
        self.ties = tie_groups(layout.tied, self.dims, model)
        self.signature, self.report = signature, report
        self.microbatches = layout.microbatches
        mine = [g for g in graphs if recorded(g).stage.index % pp.size == pp.rank]
        self.modules, self.stages, self.stage_graphs, self.graph_of = [], [], {}, {}
        self.module = nn.Module()  # every parameter and buffer of this rank's stages, original names
        start = time.perf_counter()
        for gm in mine:
            module = StageModule(model, gm, signature.constants, ctx.mesh)
            self.graph_of[module.stage.index] = gm
            inputs, carried = self._example_inputs(module, gm)
            # Passes that name the graph's inputs (overlap) read this stage's; data-parallel
            # passes find this pipeline's data-parallel dimension on its mesh.
            names = [None if isinstance(s, str) or s.kind != "parameter" else s.target for s in module.stage.inputs]
            stage_ctx = replace(ctx, example_inputs=inputs, input_names=names, mesh=self.dims.mesh or ctx.mesh)
            manager.announce(f"stage{module.stage.index}", gm, stage_ctx)
            run, compiled = compile_graph(gm, inputs, manager, stage_ctx)
            check_same_order(module.stage.index, compiled, stage_ctx.mesh)  # else its peers wait for ever
            object.__setattr__(module, "run", run)
            outputs = [example_value(n.meta["val"], True) for n in pytree.tree_leaves(gm.graph.output_node().args[0])]
            self.stages.append(PipelineStage(module, module.stage.index, module.stage.num_stages, ctx.device,
                                             input_args=tuple(carried), output_args=tuple(outputs),
                                             group=pp.group))
            self.modules.append(module)
            self.stage_graphs[module.stage.index] = compiled
            for slot in module.resident:
                if slot.kind in ("parameter", "buffer"):
                    register_as(self.module, model, slot.target, slot.kind)
        report.compile_seconds = time.perf_counter() - start
        report.sections["pipeline"] = self.layout.table()
        scale = 1.0 / self.microbatches
        schedule_class = get_schedule_class(layout.schedule)
        single = issubclass(schedule_class, PipelineScheduleSingle)
        self.schedule = schedule_class(self.stages[0] if single else self.stages, layout.microbatches,
                                       loss_fn=lambda loss, _target: loss * scale, scale_grads=False)
        self.holds_first = any(s.is_first for s in self.stages)
        self.holds_last = any(s.is_last for s in self.stages)
        # Gradients averaged over data-parallel replicas inside each backward by a pass (overlap), or
        # here after the schedule, in one all-reduce.
        # (tensor parallel communicates within a replica: it averages nothing)
        self.averages_in_graph = any({"dp_replicate", "dp_shard"} & set(pass_info(p).mesh_dims)
                                     for p in manager.declared("communicates"))
        self.last_rank = dist.get_global_rank(pp.group, (layout.total_stages - 1) % pp.size)

    def _example_inputs(self, module: StageModule, gm: fx.GraphModule) -> tuple[list, list]:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        carried = [example_value(n.meta["val"], module.stage.index > 0) for n in placeholders[len(module.resident):]]
        return module.resident_values() + carried, carried

    @property
    def graphs(self) -> dict:
        return self.stage_graphs[min(self.stage_graphs)]

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.graph_of[min(self.graph_of)]

    def __call__(self, model, args, kwargs):
        raise RuntimeError("this model is pipelined: use opt.forward_backward(**batch), which runs the schedule's "
                           "forward and backward on every rank and returns the loss; opt(...) cannot return a "
                           "forward alone.")

    def forward_backward(self, model, args, kwargs) -> torch.Tensor:
        user = [x.contiguous() for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        batch = user[0].shape[0]
        if batch % self.microbatches:
            raise ValueError(f"Pipeline: {self.microbatches} micro-batches do not divide the batch of {batch}.")
        losses: list[torch.Tensor] = []
        target = torch.zeros(batch, 1, device=user[0].device)  # the last stage computes the loss; the schedule wants one
        step_args = user if self.holds_first else []
        step_kwargs = {"target": target, "losses": losses} if self.holds_last else {}
        with reduce_after(model):  # Shard stage 1: the micro-batches' whole gradients reduced once
            self.schedule.step(*step_args, return_outputs=False, **step_kwargs)
        loss = torch.stack([x.detach().float() for x in losses]).sum() if self.holds_last else \
            torch.zeros((), device=user[0].device)
        dist.broadcast(loss, src=self.last_rank, group=self.dims.pp.group)
        for name, group in self.ties:  # a tied parameter's gradient: the sum of its stages' parts
            param = self.module.get_parameter(name)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad, group=group)
        if self.dims.dp is not None and not self.averages_in_graph:
            average_gradients(self.module.parameters(), self.dims.dp.group)
        return loss

    def predict_stages(self, cost_model) -> dict[int, float]:
        """Predicted seconds of each of this rank's stages for one micro-batch: the compiled forward
        and backward graphs, node by node (no communication), by stage index."""
        return {index: cost_model.graph_time(graphs["forward"]) + cost_model.graph_time(graphs["backward"])
                for index, graphs in self.stage_graphs.items()}

    def measure_stages(self, repeats: int = 5) -> dict[int, list[float]]:
        """Seconds of each of this rank's stages for one micro-batch, forward + backward, run alone
        on example inputs (no communication), `repeats` times after a warm-up, by stage index.
        Clears the stages' gradients."""
        times = {}
        for module in self.modules:
            samples = []
            for _ in range(repeats + 1):
                _, carried = self._example_inputs(module, self.graph_of[module.stage.index])
                start = time.perf_counter()
                out = module(*carried)
                outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                samples.append(time.perf_counter() - start)
            module.zero_grad(set_to_none=True)
            times[module.stage.index] = samples[1:]
        return times


def tie_groups(tied: dict, dims: PipelineDims, model: nn.Module) -> list:
    """(parameter name, process group of the ranks whose stages read it) for each tied parameter
    this rank holds; every rank of the world creates every group, in the same order."""
    if not tied:
        return []
    if dims.pipelines is None:
        ties = [f"{' = '.join(parameter_names(model, name))} read by stages {stages}" for name, stages in tied.items()]
        raise ValueError(f"Pipeline: a parameter read by more than one stage (tied weights): {'; '.join(ties)}; "
                         "with a group of your own picofx cannot sum its gradients: pass a DeviceMesh, untie it, "
                         "or name cuts that keep it in one stage.")
    wanted = []
    for name, stages in sorted(tied.items()):
        for ranks in dims.pipelines:
            members = sorted({ranks[s % dims.pp.size] for s in stages})
            if len(members) > 1:  # else the rank's own stages: autograd already sums them
                wanted.append((name, members))
    groups = subgroups([members for _, members in wanted])
    return [(name, group) for (name, _), group in zip(wanted, groups) if group is not None]


def check_same_cuts(layout, group: dist.ProcessGroup) -> None:
    """Every rank of the pipeline must have cut the model at the same places (a cost model
    calibrated on each rank apart can disagree); compared before any stage talks to another."""
    mine = [layout.units[c].label for c in layout.plan.cuts]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs != mine:
            raise RuntimeError(f"Pipeline: pipeline rank {rank} cut the model before {theirs}, this rank before "
                               f"{mine}; give every rank the same cost model (calibrate on one rank and "
                               "broadcast the device description) or name the cuts (balance=[module paths]).")


def average_gradients(parameters, group: dist.ProcessGroup) -> None:
    """Average gradients across a data-parallel group: one flat all-reduce (sum, then divide:
    gloo has no average). A tensor-parallel parameter's gradient is a DTensor: its local piece is
    averaged with the same piece of the other replicas."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
