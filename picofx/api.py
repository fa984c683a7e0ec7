"""`picofx.optimize`: capture, run the passes stage by stage, compile; a module that trains like the model."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.distributed.tensor import DTensor

from picofx.capture.explain import argument_name, call_arguments
from picofx.capture.export import Signature, capture_call, input_changes, input_key, split_inputs
from picofx.cost.model import CostModel
from picofx.errors import InputShapeError
from picofx.manager import Context, PassManager, Stage, SyncMode, pass_info, resolve_passes
from picofx.manager.combinations import check_combination
from picofx.manager.dump import DumpGraphs
from picofx.manager.progress import Progress, tell
from picofx.manager.report import Report, notices
from picofx.parallel.mesh import ParallelMesh, mesh_for, root_of_sub_meshes
from picofx.runtime.cache import (GraphCache, JointDecisions, JointMismatch, NotCacheable, cache_key, cached_records,
                                  cached_signature, default_directory, prepared_graph)
from picofx.runtime.compile import compile_graph
from picofx.runtime.distributed import (GradientSync, check_layouts, compression_state,
                                        note_compression_errors)
from picofx.runtime.hf import optimized_class
from picofx.runtime.measure import compile_measured, measure_step_peak, measuring_passes
from picofx.runtime.pipeline import PipelineStep
from picofx.runtime.placement import local_values, place, placements
from picofx.runtime.shard import whole_parameters
from picofx.parallel.layouts import ShardLayout, recorded
from picofx.capture.vocabulary import SIGNATURE_META


def graph_inputs(signature: Signature, model: nn.Module, args: tuple, kwargs: dict, placed=()) -> list:
    """The graph's placeholders' values for a call: the model's own parameters and buffers, and the
    call's tensors made contiguous (compiled code is specialised on the captured strides). `placed`:
    the graph's placements (picofx.runtime.placement), whose parameters it takes as local pieces
    (a shard's padded rows, a tensor-parallel piece)."""
    user = [x.contiguous() for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    values = [user[int(slot.target)] if slot.kind == "user" else slot.resident_value(model, signature.constants)
              for slot in signature.inputs]
    names = [slot.target if slot.kind == "parameter" else None for slot in signature.inputs]
    values = local_values(placed, names, values)
    return [v.to_local() if isinstance(v, DTensor) else v for v in values]  # placed parameters: their pieces


@dataclass
class CompiledStep:
    signature: Signature
    run: object                    # list of inputs -> list of outputs
    graph_module: fx.GraphModule   # the transformed forward graph, before partitioning
    graphs: dict                   # "joint", "forward", "backward" graphs as the passes left them
    report: Report
    placed: tuple = ()  # the recorded layouts that placed the parameters (picofx.runtime.placement)

    @property
    def shards(self) -> ShardLayout | None:
        """Pass shard's layout: the parameters the graph takes as local shards."""
        return recorded(self.graph_module).shards

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict):
        outputs = self.run(graph_inputs(self.signature, model, args, kwargs, self.placed))
        user_outputs = []
        with torch.no_grad():
            for (kind, target), value in zip(self.signature.outputs, outputs):
                if kind == "buffer":
                    model.get_buffer(target).copy_(value)
                else:
                    user_outputs.append(value)
        return pytree.tree_unflatten(user_outputs, self.signature.out_spec)


def shard_layout(step) -> ShardLayout | None:
    """The ShardLayout of a compiled step that shards its parameters (a pipeline's step has none here)."""
    return step.shards if isinstance(step, CompiledStep) else None


def captured_inputs(manager: PassManager, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs to capture: a pass that runs the step in micro-batches (pipeline) captures one."""
    for p in manager.declared("microbatches"):
        args, kwargs = p.capture_inputs(args, kwargs)
    return args, kwargs


def forward_context(model: nn.Module, signature: Signature, inputs: list, *, backend: str, options: dict,
                    cost_model=None, **fields) -> Context:
    """What the forward passes read about the captured graph `signature` describes; `fields`:
    Context's mesh, gradient_sync, cache_directory."""
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    input_names = [slot.target if slot.kind == "parameter" else None for slot in signature.inputs]
    return Context(model=model, example_inputs=inputs, device=device, backend=backend, options=options,
                   cost_model=cost_model or CostModel.for_backend(device, backend), input_names=input_names,
                   **fields)


def build_step(model, args, kwargs, *, passes, loss_fn, backend, verify, instruments, options,
               cost_model, cache: GraphCache | None = None, mesh=None,
               gradient_sync: SyncMode = SyncMode.SYNC) -> CompiledStep:
    """One capture and compilation, for the call's input shapes. The order of stages is fixed:
    forward passes see the captured graph; joint and partitioned passes run inside compilation.
    Within a stage the passes run in the order the manager put them in (their declared constraints,
    else as given); the report says when that is not the order given."""
    manager = PassManager(passes, verify=verify, instruments=instruments)
    args, kwargs = captured_inputs(manager, args, kwargs)
    key, entry, cache_note = None, None, None
    if cache is not None:  # a hit skips capture and the forward passes, and replays the joint passes' tags
        try:
            key = cache_key(model, input_key(args, kwargs), passes=manager.passes, loss_fn=loss_fn, backend=backend,
                            verify=verify, instruments=instruments, options=options, cost_model=cost_model)
            entry, cache_note = cache.load(key)
        except NotCacheable as e:
            cache_note = f"off: {e}"
    tell(instruments, "begin", cached=entry is not None)
    start = time.perf_counter()
    with whole_parameters(model):  # a model an earlier step sharded is captured whole
        gm = None if entry else capture_call(model, args, kwargs, loss_fn)
        signature = cached_signature(entry) if entry else gm.meta[SIGNATURE_META]
        report = Report(backend=backend, input_key=input_key(args, kwargs),
                        capture_seconds=time.perf_counter() - start,
                        records=cached_records(entry) if entry else manager.records,
                        sections={"cache": cache_note} if cache_note else {})
        if manager.order_changes:
            report.sections["pass order"] = manager.order_changes
        inputs = graph_inputs(signature, model, args, kwargs)
        gm = prepared_graph(entry, inputs, signature) if entry else gm
        ctx = forward_context(model, signature, inputs, backend=backend, cost_model=cost_model, options=options,
                              mesh=mesh, gradient_sync=gradient_sync,
                              cache_directory=cache.directory if cache else None)
        manager.announce("captured", gm, ctx)
        graphs = [gm] if entry else manager.run(Stage.FORWARD, gm, ctx)
    if len(graphs) != 1:  # pipeline stages: this rank compiles and runs its own
        step = PipelineStep(graphs, model, manager, ctx, report, signature)
        tell(instruments, "end", backend=backend)
        return step
    placed = placements(graphs[0])
    if placed:  # the ranks agree on the layouts, then the parameters are placed
        place(placed, model, ctx.mesh)
        if recorded(graphs[0]).tensor_parallel is not None:
            report.sections["tensor_parallel"] = recorded(graphs[0]).tensor_parallel.table()
        inputs = ctx.example_inputs = graph_inputs(signature, model, args, kwargs, placed)
    start = time.perf_counter()
    if measuring_passes(manager):  # compile, measure a real step, re-plan if it asks (picofx.runtime.measure)
        def peak_of(compiled):
            step = CompiledStep(signature, compiled[0], graphs[0], compiled[1], report, placed)
            return measure_step_peak(lambda: step(model, args, kwargs), model, (args, kwargs))

        run, stage_graphs = compile_measured(graphs[0], lambda gm: compile_graph(gm, inputs, manager, ctx),
                                             manager, peak_of)
    else:
        joint = JointDecisions(entry["joint"] if entry else None) if key else None
        try:
            run, stage_graphs = compile_graph(graphs[0], inputs, manager, ctx, joint)
        except JointMismatch:  # the entry does not fit what AOT traces now: build afresh and replace it
            cache.forget(key)
            return build_step(model, args, kwargs, passes=passes, loss_fn=loss_fn, backend=backend, verify=verify,
                              instruments=instruments, options=options, cost_model=cost_model, cache=cache,
                              mesh=mesh, gradient_sync=gradient_sync)
        if key and not entry:
            report.sections["cache"] += "; " + cache.save(key, graphs[0], signature, manager.records, joint)
    report.compile_seconds = time.perf_counter() - start
    tell(instruments, "end", backend=backend)
    check_layouts(stage_graphs)  # collective when a pass all-reduces: ranks agree before the first backward
    return CompiledStep(signature, run, graphs[0], stage_graphs, report, placed)


class OptimizedModule(nn.Module):
    """Trains like `model`: same call, same outputs, the model's own parameters and state_dict keys."""

    def __init__(self, model: nn.Module, example_inputs, recapture: bool, **build_options):
        object.__setattr__(self, "_model", model)
        nn.Module.__init__(self)  # not super(): optimize's subclass may also derive from the model's class
        # Share the model's containers: parameters, buffers and submodules are the model's own objects,
        # so .parameters(), .to(), optimizers and checkpoints see exactly what they would see on `model`.
        self._modules, self._parameters, self._buffers = model._modules, model._parameters, model._buffers
        self.training = model.training
        object.__setattr__(self, "_build_options", build_options)
        object.__setattr__(self, "_recapture", recapture)
        object.__setattr__(self, "_steps", {})
        object.__setattr__(self, "_sync", GradientSync(model))
        args, kwargs = split_inputs(example_inputs)
        object.__setattr__(self, "_first_call", (args, kwargs))
        self._step_for(args, kwargs)

    def _step_for(self, args: tuple, kwargs: dict, gradient_sync: SyncMode = SyncMode.SYNC) -> CompiledStep:
        key = (self._model.training, input_key(args, kwargs), gradient_sync)
        step = self._steps.get(key)
        if step is None:
            if self._steps and not self._recapture and gradient_sync is SyncMode.SYNC:
                raise InputShapeError(describe_input_change(*self._first_call, args, kwargs))
            start = time.perf_counter()
            step = build_step(self._model, args, kwargs, **self._build_options, gradient_sync=gradient_sync)
            if self._steps:  # a recompilation: one line saying why and what it cost
                first_mode = next(iter(self._steps))[0]
                changed = [input_changes(*self._first_call, args, kwargs),
                           ("train" if key[0] else "eval") + " mode" if key[0] != first_mode else "",
                           f"gradient sync {gradient_sync}" if gradient_sync is not SyncMode.SYNC else ""]
                notices().info(f"{'; '.join(c for c in changed if c) or 'new call'}: captured and compiled "
                               f"again in {time.perf_counter() - start:.1f}s (recompilation {len(self._steps)})")
            self._steps[key] = step
        object.__setattr__(self, "_current", step)
        return step

    def forward(self, *args, **kwargs):
        step = self._step_for(args, kwargs)
        mode = self._sync.mode(step.graphs, shard_layout(step))
        if mode is not SyncMode.SYNC:  # no_sync, the synced call after it, or a warm-up step: a variant of the backward
            step = self._step_for(args, kwargs, mode)
            self._sync.before_call(mode, step.graphs, self._model)
        return step(self._model, args, kwargs)

    def forward_backward(self, *args, **kwargs) -> torch.Tensor:
        """One training step's forward and backward (gradients land in `.grad`); returns the loss.
        Data-parallel runs average the gradients over ranks inside the backward (pass `overlap`).
        A pipelined model (pass `pipeline`) runs its schedule and returns the loss on every rank."""
        step = self._step_for(args, kwargs)
        if isinstance(step, PipelineStep):
            return step.forward_backward(self._model, args, kwargs)
        out = self(*args, **kwargs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        return loss.detach()

    def no_sync(self):
        """As DistributedDataParallel.no_sync: backwards inside accumulate each rank's own
        gradients without communication; the first backward after it all-reduces the accumulated
        sum (compiles a variant of the step for each, once)."""
        return self._sync.no_sync()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """As FSDP2's: False makes the next backwards behave as under no_sync() until set True again."""
        self._sync.set_enabled(requires_gradient_sync)

    @property
    def compression(self):
        """The gradient compressors' state kept between steps (error-feedback residuals, PowerSGD's
        Q; pass overlap's `compress`), or None. Save it with the model's DCP checkpoint:
        `dcp.save({"model": ..., "compression": opt.compression})`; it loads in place."""
        return next((s for step in self._steps.values()
                     if (s := compression_state(step.graphs, shard_layout(step)))), None)

    def reset_compression(self) -> None:
        """Forget the compressors' state: residuals to zero, PowerSGD's Q to its first value, and
        the uncompressed warm-up steps (Overlap's and Shard's `warmup`) start again."""
        if self.compression is not None:
            self.compression.reset()
        self._sync.warmed = 0

    @property
    def report(self) -> Report:
        self._current.report.recompilations = len(self._steps) - 1
        # what Report.to_html draws from: the partitioned graphs, and the transformed forward with its layouts
        self._current.report.graphs = {"transformed": self._current.graph_module, **self._current.graphs}
        note_compression_errors(self._current.report.records, self._current.report.graphs)  # shard's: "transformed"
        return self._current.report

    @property
    def graph_module(self) -> fx.GraphModule:
        return self._current.graph_module

    @property
    def graphs(self) -> dict:
        return self._current.graphs

    @property
    def parallel_mesh(self) -> ParallelMesh | None:
        """The run's layout of ranks and its dimensions' process groups (None in one process)."""
        return self._build_options["mesh"]

    @property
    def pipeline(self) -> PipelineStep | None:
        """This rank's part of a pipelined step (its plan, stages, `measure_stages`), else None."""
        return self._current if isinstance(self._current, PipelineStep) else None

    def _held(self) -> nn.Module:
        """What this process trains: the model, or a pipelined model's stages on this rank."""
        return self._current.module if isinstance(self._current, PipelineStep) else self._model

    def named_parameters(self, *args, **kwargs):
        return self._held().named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self._held().parameters(recurse)

    def state_dict(self, *args, **kwargs):
        return self._held().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._held().load_state_dict(*args, **kwargs)

    def train(self, mode: bool = True):
        self._model.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._model, name)


def describe_input_change(args0: tuple, kwargs0: dict, args: tuple, kwargs: dict) -> str:
    old, old_spec = pytree.tree_flatten_with_path((args0, kwargs0))
    new, new_spec = pytree.tree_flatten_with_path((args, kwargs))
    if old_spec != new_spec:
        return (f"the call passes {call_arguments(args, kwargs)}, the graph was captured with "
                f"{call_arguments(args0, kwargs0)}; call with the same arguments, or optimize with recapture=True.")
    for (path, a), (_, b) in zip(old, new):
        name = argument_name(path)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            for dim, (x, y) in enumerate(zip(a.shape, b.shape)):
                if x != y:
                    return (f"{name} has shape {tuple(b.shape)}, but the graph was captured with {tuple(a.shape)} "
                            f"(dimension {dim}: {y} vs {x}); optimize with recapture=True to capture each new shape.")
            if a.dim() != b.dim() or a.dtype != b.dtype:
                return f"{name} is {b.dtype} {tuple(b.shape)}, captured as {a.dtype} {tuple(a.shape)}."
        elif not isinstance(a, torch.Tensor) and a != b:
            return f"{name} is {b!r}, captured as {a!r}; the graph is specialised on it."
    return "the model's train/eval mode changed since capture; optimize with recapture=True."


def optimize(model: nn.Module, example_inputs, passes=(), *, backend: str = "inductor", loss_fn=None,
             verify: str | None = "invariants", dump_dir: str | None = None, instruments=(),
             recapture: bool = True, options: dict | None = None, cost_model=None,
             progress=None, mesh=None) -> OptimizedModule:
    """Capture `model`'s training step on `example_inputs`, run `passes`, compile with `backend`.

    passes:    names ("fuse") or pass objects (picofx.passes.Checkpoint(budget="8GiB")), any order:
               each runs at its own stage, and where a pass declares it must run before or after
               another (tensor_parallel before fuse and shard, ...) the manager orders them so
               (opt.report's "pass order" says when it did); otherwise they run in the order given.
    backend:   "inductor" (torch.compile's code generation) or "eager" (run the graphs as they are).
    loss_fn:   for models that return logits: `loss_fn(output, labels)`; the call then passes `labels=`.
    verify:    after every pass, "invariants" (default), "numerics" (also compare outputs and gradients
               with the graph before the pass) or None.
    dump_dir:  write every graph (`NN_<pass>.txt` and `.dot`) there.
    progress:  a function of one string (e.g. print) told each step (capture, each pass, compile)
               as it finishes, with its time.
    recapture: a call with other input shapes captures and compiles again; False raises instead.
    cost_model: what passes predict time and memory with (default: picofx.cost.model.CostModel for
               the inputs' device; pass one built on a calibrated picofx.cost.device description).
    mesh:      the run's layout of ranks (picofx.parallel.ParallelMesh, or a DeviceMesh whose
               dimensions are named "pp", "dp_replicate", "dp_shard", "tp"); by default, under
               torchrun, the distributed passes' dimensions, the data-parallel one taking the ranks
               left over. Passes find their process groups on it.
    """
    # The on-disk cache of optimized graphs (picofx.runtime.cache): PICOFX_CACHE=0 turns it off.
    cache = None if os.environ.get("PICOFX_CACHE", "1") == "0" else \
        GraphCache(os.environ.get("PICOFX_CACHE_DIR") or default_directory())
    instruments = [*instruments, *([DumpGraphs(dump_dir)] if dump_dir else []),
                   *([Progress(progress)] if progress else [])]
    passes = resolve_passes(passes)
    module_class = optimized_class(OptimizedModule, model, loss_fn, passes)  # the model's call and HF surface
    check_combination(passes, mesh)  # a combination the table refuses: before capture and before any rank waits
    return module_class(model, example_inputs, recapture, passes=passes, loss_fn=loss_fn, backend=backend,
                        verify=verify, instruments=instruments, options=options or {}, cost_model=cost_model,
                        cache=cache, mesh=run_mesh(mesh, passes, model))


def run_mesh(mesh, passes: list, model: nn.Module) -> ParallelMesh | None:
    """The run's ParallelMesh: the user's (a DeviceMesh is named into one), else the one the
    distributed passes ask for (None in a single process)."""
    if mesh is None:  # sub-meshes of one DeviceMesh given to the passes: the run's mesh is that one
        mesh = root_of_sub_meshes([getattr(p, field, None) for p in passes for field in ("mesh", "group")])
    if mesh is None:
        device = next(model.parameters(), torch.empty(0)).device
        return mesh_for([(pass_info(p).mesh_dims, pass_info(p).mesh_size) for p in passes], device.type)
    if isinstance(mesh, ParallelMesh):
        return mesh
    return ParallelMesh.from_device_mesh(mesh)
