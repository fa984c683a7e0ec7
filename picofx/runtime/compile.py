"""Compile the transformed forward graph for training, running the joint and partitioned stages.

backend="eager":    aot_autograd(fw_compiler, bw_compiler, partition_fn) runs every stage and
                    executes the resulting GraphModules as they are (no code generation); with a
                    cost model of Inductor (`fuses_pointwise`) it decomposes as Inductor does, so
                    that predictions see Inductor's graphs.
backend="inductor": Inductor's own hooks run the same stages (joint_custom_post_pass,
                    custom_partitioner_fn, post_grad_custom_post_pass), then Inductor generates code.
Both partition with picofx.cost.partition (torch's `default_partition`, which honours `recompute`
tags exactly) when a joint pass tagged nodes for recomputation or planned memory for that
partition (`plans_partition`, as `checkpoint` does); otherwise Inductor keeps its min-cut
partitioner and eager saves what the forward computed.
"""
from __future__ import annotations

import dataclasses

import warnings

import torch
from torch import fx
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn
from torch._inductor.exc import InductorError
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.graph import _BoxedCodeGen

from picofx.capture.annotate import annotate
from picofx.capture.vocabulary import FLOAT8_META
from picofx.cost.partition import partition
from picofx.errors import PassError
from picofx.kernels.lowering import has_triton_kernel, triton_lowering, with_backward_ops
from picofx.manager import Context, GraphRole, PassManager, Stage, pass_info


def has_recompute_tags(gm: fx.GraphModule) -> bool:
    return any("recompute" in n.meta for n in gm.graph.nodes)


class StageRunner:
    """Runs the joint and partitioned stages of one compilation with real inputs for verification."""

    def __init__(self, manager: PassManager, ctx: Context, primals: list, joint=None):
        self.manager, self.ctx, self.primals = manager, ctx, primals
        self.joint = joint  # picofx.runtime.cache.JointDecisions: record the joint passes' tags, or replay them
        self.forward_outputs: list = []
        self.numerics = manager.verify == "numerics"
        self.graphs: dict[str, fx.GraphModule] = {}

    def _context(self, stage: Stage, role: GraphRole, inputs) -> Context:
        return dataclasses.replace(self.ctx, example_inputs=inputs, stage=stage, graph_role=role)

    def _real_inputs(self, gm: fx.GraphModule, role: GraphRole) -> list | None:
        """Real values for the graph's placeholders: the example primals; for the backward graph the
        values the forward graph saved (its trailing outputs, in order); ones for the tangents."""
        if not self.numerics:
            return None
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if role is GraphRole.BACKWARD:
            saved_count = sum(1 for n in placeholders if not n.name.startswith("tangents"))
            known = iter(self.forward_outputs[len(self.forward_outputs) - saved_count:])
        else:
            known = iter(self.primals)
        inputs = []
        for node in placeholders:
            val = node.meta["val"]
            if not node.name.startswith("tangents"):
                inputs.append(next(known))
            elif isinstance(val, torch.Tensor):  # the loss's seed and any other output's cotangent
                inputs.append(torch.ones(val.shape, dtype=val.dtype, device=self.ctx.device))
            else:
                inputs.append(val)
        return inputs

    def run(self, stage: Stage, role: GraphRole, gm: fx.GraphModule) -> fx.GraphModule:
        with unset_fake_temporarily():
            annotate(gm)
            ctx = self._context(stage, role, self._real_inputs(gm, role))
            self.manager.announce(f"{stage.value}.{role}" if stage is Stage.PARTITIONED else stage.value, gm, ctx)
            recording = stage is Stage.JOINT and self.joint is not None
            if recording and self.joint.replaying:
                self.joint.replay(gm)
                graphs = [gm]
            else:
                if recording:
                    self.joint.before_passes(gm)
                graphs = self.manager.run(stage, gm, ctx)
                if recording:
                    self.joint.after_passes(graphs[0])
            if len(graphs) != 1:
                raise NotImplementedError(f"a {stage.value}-stage pass split the {role} graph; "
                                          "only forward-stage passes may split graphs.")
            if role is GraphRole.FORWARD and self.numerics:
                self.forward_outputs = list(fx.Interpreter(graphs[0]).run(*ctx.example_inputs))
        self.graphs[role.value] = graphs[0]
        return graphs[0]

    # backend="eager": aot_autograd callbacks
    def eager_partition(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        self.run(Stage.JOINT, GraphRole.JOINT, joint)
        return partition(joint, joint_inputs, **kwargs)

    def eager_forward(self, gm: fx.GraphModule, example_inputs):
        return make_boxed_func(self.run(Stage.PARTITIONED, GraphRole.FORWARD, gm).forward)

    def eager_backward(self, gm: fx.GraphModule, example_inputs):
        gm = self.run(Stage.PARTITIONED, GraphRole.BACKWARD, gm)
        # Boxed: the graph takes its inputs as a list and clears it, so each saved activation is
        # freed after its last use in backward instead of when the whole backward returns.
        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()

        def run(args):
            return gm(args)

        run._boxed_call = True
        return run


class _JointHook(CustomGraphPass):
    def __init__(self, runner: StageRunner):
        self.runner = runner

    def __call__(self, graph: fx.Graph) -> None:
        self.runner.run(Stage.JOINT, GraphRole.JOINT, graph.owning_module)

    def uuid(self):
        return None  # never reuse a cached compile: the passes' decisions depend on the model


class _PostGradHook(_JointHook):
    def __call__(self, graph: fx.Graph) -> None:
        role = GraphRole.BACKWARD if any(n.op == "placeholder" and n.name.startswith("tangents")
                                         for n in graph.nodes) else GraphRole.FORWARD
        self.runner.run(Stage.PARTITIONED, role, graph.owning_module)


class _Partitioner(CustomPartitionerFn):
    """picofx's partition where a pass planned memory for it (it saves what the backward reads,
    recomputes what is tagged); Inductor's min-cut partition otherwise."""

    def __init__(self, manager: PassManager):
        self.planned = bool(manager.declared("plans_partition"))

    def __call__(self, gm, joint_inputs, **kwargs):
        if self.planned or has_recompute_tags(gm):
            kwargs.pop("compiler", None)
            return partition(gm, joint_inputs, **kwargs)
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def uuid(self):
        return None


# Inductor's scheduler otherwise waits for each collective right after issuing it, which undoes
# the overlap the graph was built with: raise collectives to where their inputs are ready and sink
# waits to their first reader (the newer overlap scheduler does not run on CPU/gloo).
COMM_OVERLAP = {"reorder_for_compute_comm_overlap": True,
                "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms"]}
# Parameter all-gathers (pass shard) raised that way all move to the top of the forward, which then
# holds every layer's gathered weights at once, and compute no collective reads (tensor_parallel's
# weight-gradient matmuls) moves to the end of the backward; these passes keep the graph's order,
# each wait as late as its first use allows, without raising the step's peak.
GATHER_OVERLAP = {"reorder_for_compute_comm_overlap": True,
                  "reorder_for_compute_comm_overlap_passes": ["reorder_communication_preserving_peak_memory",
                                                              "sink_waits_iterative",
                                                              "reorder_communication_preserving_peak_memory"]}


def inductor_decompositions(device: torch.device) -> dict:
    """Inductor's table plus picofx's fused ops as plain ATen ops, on every device: on CPU Inductor
    writes them into its C++ loops; on CUDA those not launched as Triton kernels (`triton_lowered_ops`)
    are fused into its Triton kernels. Either way no fused op is left an opaque call."""
    from torch._inductor.decomposition import select_decomp_table

    from picofx.kernels import inductor_decompositions as fused_op_decompositions

    return {**select_decomp_table(), **fused_op_decompositions()}


def triton_lowered_ops(gm: fx.GraphModule, device: torch.device) -> set[str]:
    """The fused ops of `gm` Inductor launches as picofx's Triton kernels: on CUDA, each op that has
    one, unless fuse chose its decomposition for every node of it (node.meta["lowering"])."""
    if device.type != "cuda":
        return set()
    names = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            name = node.target.name()  # "picofx::rms_norm"
            if has_triton_kernel(name) and node.meta.get("lowering", "kernel") == "kernel":
                names.add(name)
    return names


def start_kernel_compile_workers():
    """Start Inductor's Triton compile workers now, as torch.compile's backend does on entry: until
    they answer, each Triton kernel compiles in this process, one after another."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without the pool compiles in this process anyway
        return
    maybe_warm_pool()


def declare_fallbacks(decompositions: dict) -> None:
    """Have Inductor call the kernels of picofx's custom ops it is not given a decomposition for,
    declared before lowering as Inductor declares an unknown op where it first meets one. Met first
    in the graph, each op's inputs are also written out for a log line, which some torch releases
    (2.11) do even when the line is not logged: on a 16-layer model that took minutes."""
    from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, op_name = name.partition("::")
        if namespace != "picofx":
            continue
        packet = getattr(torch.ops.picofx, op_name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if op not in lowerings and op not in decompositions:
                constraint = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
                make_fallback(op, layout_constraint=constraint, warn=False)


def runs_float8(gm: fx.GraphModule) -> bool:
    """Whether the precision pass put float8 linears in `gm` (it tags each one)."""
    return any(FLOAT8_META in n.meta for n in gm.graph.nodes)


def compile_graph(gm: fx.GraphModule, inputs: list, manager: PassManager, ctx: Context, joint=None):
    """Compile `gm` (flat inputs, flat outputs) for training; returns `fn(inputs: list) -> list`.
    `joint` (picofx.runtime.cache.JointDecisions) records what the joint passes annotate, or
    replays a cached record instead of running them."""
    runner = StageRunner(manager, ctx, inputs, joint)
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        if ctx.backend == "eager":
            # Graphs whose memory a model of Inductor predicts are decomposed as Inductor's are.
            inductor_graphs = ctx.cost_model is not None and ctx.cost_model.fuses_pointwise
            kernels = with_backward_ops(triton_lowered_ops(gm, ctx.device))  # Inductor would not decompose these
            decompositions = {op: f for op, f in inductor_decompositions(ctx.device).items()
                              if op.name() not in kernels} if inductor_graphs else None
            fn = aot_module_simplified(gm, inputs, fw_compiler=runner.eager_forward,
                                       bw_compiler=runner.eager_backward, partition_fn=runner.eager_partition,
                                       decompositions=decompositions)
        elif ctx.backend == "inductor":
            from torch._inductor import config as inductor_config
            with warnings.catch_warnings():  # its first import loads torch.utils.mkldnn, which uses torch.jit
                warnings.filterwarnings("ignore", message=r"`torch.jit.script_method` is deprecated",
                                        category=DeprecationWarning)
                from torch._inductor.compile_fx import compile_fx
            if ctx.device.type == "cuda":
                start_kernel_compile_workers()
            decompositions = inductor_decompositions(ctx.device)
            declare_fallbacks(decompositions)

            hooks = {"joint_custom_post_pass": _JointHook(runner), "custom_partitioner_fn": _Partitioner(manager),
                     "post_grad_custom_post_pass": _PostGradHook(runner)}
            communicating = manager.declared("communicates")
            if communicating:
                gathers = any({"dp_shard", "tp"} & set(pass_info(p).mesh_dims) for p in communicating)
                hooks.update(GATHER_OVERLAP if gathers else COMM_OVERLAP)
            if ctx.device.type == "cpu" and runs_float8(gm):  # float8 on a CPU is for numerics: eager's roundings
                hooks["emulate_precision_casts"] = True
            with inductor_config.patch(hooks), triton_lowering(triton_lowered_ops(gm, ctx.device)):
                try:
                    fn = compile_fx(gm, inputs, decompositions=decompositions)
                except InductorError as e:  # Inductor wraps what its post-grad hook raised: a pass's PassError
                    if isinstance(e.inner_exception, PassError):
                        raise e.inner_exception from e.inner_exception.__cause__
                    raise
        else:
            raise ValueError(f"backend must be 'eager' or 'inductor', got {ctx.backend!r}")
    # Both entry points return a function of unboxed arguments (whatever its `_boxed_call` says).
    return (lambda args: fn(*args)), runner.graphs
