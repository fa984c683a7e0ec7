"""shard: sharded data parallel (ZeRO-3, as FSDP2 shards) inside the captured step.

Forward stage: every parameter placeholder takes this rank's dim-0 shard, padded to the common
row count P = ceil(rows / N), instead of the whole tensor. The parameters, in the order the
forward first reads them, are cut into buckets (a decoder layer's by default); each bucket's shards
travel in one all-gather, issued `prefetch` buckets ahead and waited just before first use:

    gathered = _c10d_functional_autograd.all_gather_into_tensor(cat(shards), N, group)
    whole_i = wait_tensor(gathered).view(N, M)[:, off_i:off_i + m_i].reshape(N * P_i, ...)[:rows_i]

The autograd all-gather's backward is a reduce-scatter (sum), so the backward hands each rank the
gradient of its own padded shard. Partitioned stage (backward graph): those gradients are divided
by N, since gloo has no "avg" (DDP's average); with mixed precision reducing in another dtype than
it gathers (FSDP2's reduce_dtype), each reduce-scatter reads the gradient in that dtype. Joint stage, with reshard_after_forward: the gathers
and what views them are tagged for recomputation, so the backward gathers again instead of keeping
the whole parameters alive between forward and backward. The decision is recorded as a ShardLayout
on the forward graph; the runtime (picofx.runtime.shard) turns the model's parameters into DTensor
shards and feeds the graph their padded local pieces.

With `compress`, each bucket's reduce-scatter becomes a codec's exchange (compress.py, beside this file).
With precision's tensorwise float8, the weights only float8 linears read are gathered as float8 bytes
with the whole weights' scales, in buckets of their own (float8_gather.py, beside this file).

Shard runs after the passes that rewrite the forward graph (fuse, precision; its PassInfo says
so, and the manager orders the passes by it): they see the parameters whole.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.checkpoint import CheckpointPolicy

from picofx.capture.annotate import fake_mode_of
from picofx.capture.vocabulary import COPY_PACKETS, input_slot, is_parameter, is_view, layer_of_path
from picofx.cost.units import parse_budget
from picofx.manager import Context, GraphRole, PassInfo, PassResult, Stage, register_pass
from picofx.parallel.layouts import ShardEntry, ShardLayout, layouts_of
from picofx.cost.liveness import schedule_of
from picofx.errors import DistributedError
from picofx.parallel.mesh import ALIASES, MeshDim, ParallelMesh, resolve_dim
from picofx.compression import CompressionState, Dense
from picofx.parallel.gradient_sums import drop_gradient_sums, forward_gradient_sums
from picofx.passes.shard.compress import compress_scatters, parse_shard_compress
from picofx.passes.shard.gather import describe_bucket, issue_gather, wait_and_unpack
from picofx.passes.shard.float8_gather import E4M3, FLOAT8_VIEWS, float8_weights, is_float8, issue_float8_gather, \
    scale_weights, shard_casts, wait_and_unpack_float8
from picofx.passes.shard.reduce import all_reduce_across, average_gradients, describe_reductions, reduce_in
from picofx.passes.shard.schedule import agreement, plain_collectives, schedule_backward
from picofx.passes.shard.stages import check_stage, record_whole

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
GATHER = torch.ops._c10d_functional_autograd.all_gather_into_tensor.default
CAST = aten._to_copy.default
CASTS = (CAST, torch.ops.prims.convert_element_type.default)  # a dtype cast, before and after decomposition
WIRE_DTYPES = (torch.bfloat16, torch.float32)  # what parameters can be gathered and gradients reduced in


def padded_rows(rows: int, world: int) -> int:
    return -(-rows // world)


def local_rows(rows: int, world: int, rank: int) -> int:
    """This rank's rows under DTensor's Shard(0) (torch.chunk's split: full chunks first)."""
    return max(0, min(rows, (rank + 1) * padded_rows(rows, world)) - rank * padded_rows(rows, world))


@register_pass("shard")
@dataclass(frozen=True)
class Shard:
    """mesh: the ranks to shard over: a mesh dimension's name, a one-dimensional DeviceMesh or a
    ProcessGroup (None: the run's mesh's dp_shard dimension, else every rank).
    reshard_after_forward: gather again in the backward (True) or keep the gathered parameters
    from the forward (False). bucket: which parameters share one all-gather: "auto" (a decoder
    layer's; FSDP2's unit), bytes or a size string ("16MiB"), or 0 (one gather per parameter).
    prefetch: issue a bucket's gather this many buckets before its first use (0: just before it),
    so it overlaps the previous layer's compute. mixed_precision: None, a
    torch.distributed.fsdp.MixedPrecisionPolicy, or "bf16" (= MixedPrecisionPolicy(param_dtype=
    torch.bfloat16)): the fp32 shards, the master copy, are gathered in param_dtype and their
    gradients reduce-scattered in reduce_dtype (None: param_dtype, as FSDP2 defaults it; fp32 with
    bf16 parameters casts each bf16 gradient up before the reduce-scatter). The graph computes in
    the dtype it did (add "precision" to compute in bf16); the call's inputs are
    not cast (cast_forward_inputs is moot for token ids); output_dtype is not supported.
    compress: None or Overlap's spelling ("bf16", "int8", "int8:ef", "topk:F", "powersgd:R",
    "sparse_rows[+KIND]"): each bucket's gradient reduce-scatter as that codec
    (picofx/passes/shard/compress.py). warmup: as Overlap's, the first steps reduce-scatter the gradients
    uncompressed (a variant of the step; sparse_rows, being exact, stays). stage: 3 (ZeRO-3, the
    above), or 1 and 2 (ZeRO-1 and -2: parameters whole in the graph, stages.py beside this file)."""

    mesh: Any = None
    reshard_after_forward: bool = True
    bucket: int | str = "auto"
    prefetch: int = 1
    mixed_precision: Any = None
    compress: str | None = None
    warmup: int = 0
    stage: int = 3
    # per optimized model: the forward's layout (the backward compresses by it) and the compressor state
    layouts: Any = field(default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False)
    # The forward's rewrites see the parameters whole; under a pipeline, each stage's graph is sharded.
    info = PassInfo(Stage.FORWARD, also_at=(Stage.JOINT, Stage.PARTITIONED), mesh_dims=("dp_shard",),
                    communicates=True, runs_after=("fuse", "precision", "pipeline"))

    def __post_init__(self):
        check_stage(self)
        precision_policy(self.mixed_precision)
        check_hsdp_mesh(self)
        object.__setattr__(self, "spec", parse_shard_compress(self.compress))
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"Shard(warmup={self.warmup!r}): a number of steps, 0 or more")
        if self.bucket not in ("auto", 0):
            parse_budget(self.bucket)
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"Shard(prefetch={self.prefetch!r}): give a count of buckets, 0 or more")

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        if self.stage < 3:  # the graph keeps its whole parameters; the runtime exchanges outside it
            return record_whole(self, gm, ctx, shard_dims, shard_entry) if ctx.stage is Stage.FORWARD else PassResult()
        if ctx.stage is Stage.FORWARD:
            return self.shard_forward(gm, ctx)
        if ctx.stage is Stage.JOINT:
            return self.tag_regather(gm) if self.reshard_after_forward else PassResult(False, {})
        if ctx.graph_role is GraphRole.BACKWARD:
            return self.exchange_gradients(gm, ctx)
        return PassResult(plain_collectives(gm) > 0, {})  # the forward graph's gathers

    def exchange_gradients(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        """The backward graph: reduce in reduce_dtype, compress, sum across replicas (HSDP), average,
        then the order the exchange runs in (schedule.py)."""
        layout = self.layouts.get(ctx.model)
        group = layout.dim.group_name if layout is not None and layout.dim.group is not None else None
        gather, reduce = precision_policy(self.mixed_precision)
        recast = reduce_in(gm, reduce, group) if reduce != gather else PassResult(False, {})
        compressed = PassResult(False, {})
        if self.compress is not None and layout is not None:
            compressed = compress_scatters(gm, ctx, self.compress, layout, layout.state)
        replicas = layout.replicas if layout is not None else None
        summed = all_reduce_across(gm, replicas, group) if replicas is not None else PassResult(False, {})
        averaged = average_gradients(gm, replicas.size if replicas else 1,  # compress_scatters' are averaged
                                     layout.summed if layout is not None else 1)
        plain_collectives(gm)
        if compressed.changed:  # a codec places its own exchange
            scheduled = {}
        else:
            scheduled = schedule_backward(gm, self.prefetch if self.reshard_after_forward else 0,
                                          backward_timeline(ctx), agreement(layout, ctx.mesh), group)
        gm.graph.lint()
        return PassResult(True, {**averaged.notes, **recast.notes, **compressed.notes, **summed.notes,
                                 "schedule": scheduled, "reductions": describe_reductions(gm, group)})

    def shard_forward(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        dim, replicas, placed_on = shard_dims(self, ctx.mesh)
        sums = forward_gradient_sums(gm, ctx.mesh) if self.mesh is None and self.compress is None else []
        if sums:  # the cp ranks' gradients are summed by the reduce-scatter itself: shard over dp_shard x cp
            drop_gradient_sums(gm, sums)
            dim = ctx.mesh.joined("dp_shard", "cp")
            placed_on = ctx.mesh.placement_mesh(replicas, dim) if replicas is not None else None
        mode = fake_mode_of(gm)
        placeholders_first(gm.graph)  # a bucket's gather reads all its shards where the first is read
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        params = []  # (first use, placeholder, whole shape) in the order the forward first reads them
        for node in [n for n in gm.graph.nodes if is_parameter(n)]:
            val = node.meta["val"]
            if val.dim() == 0:
                raise NotImplementedError(f"Shard: parameter {input_slot(node).target} is a scalar; only "
                                          "parameters with a first dimension are sharded.")
            first = min(node.users, key=order.__getitem__) if node.users else None
            params.append((first, node, tuple(val.shape)))
            with mode:  # the placeholder now takes this rank's padded shard
                node.meta["val"] = torch.empty((padded_rows(val.shape[0], dim.size), *val.shape[1:]),
                                               dtype=val.dtype, device=val.device)
        params.sort(key=lambda p: order[p[0]] if p[0] is not None else len(order))
        float8, float8_kept = float8_weights(gm)  # weights only tensorwise float8 linears read: gathered in float8
        buckets = self.buckets([p for p in params if p[0] is not None], set(float8))
        unread = [p for p in params if p[0] is None]  # sharded all the same, in no bucket
        entries = [shard_entry(ctx, node, shape, k, dim) for k, bucket in [*enumerate(buckets), (-1, unread)]
                   for _, node, shape in bucket]
        issued = [buckets[max(0, k - self.prefetch)][0][0] for k in range(len(buckets))]
        wire, reduce = precision_policy(self.mixed_precision)
        scales = scale_weights(gm.graph, [p[1] for b in buckets for p in b if p[1] in float8], dim,
                               next(n for n in gm.graph.nodes if n.op != "placeholder")) if float8 else {}
        gathers = [issue_float8_gather(gm.graph, bucket, dim, issued[k], scales) if bucket[0][1] in float8
                   else issue_gather(gm.graph, bucket, dim, issued[k], wire) for k, bucket in enumerate(buckets)]
        for bucket, gathered in zip(buckets, gathers):  # waits after every gather issued at the same place
            if bucket[0][1] in float8:
                wait_and_unpack_float8(gm.graph, bucket, gathered, dim, scales, float8, reduce or wire)
            else:
                wait_and_unpack(gm.graph, bucket, gathered, dim)
        gm.graph.eliminate_dead_code()
        wire_text = None if wire is None and reduce is None else (
            str(wire) if reduce in (None, wire) else f"{wire}, reduced in {reduce}")  # the ranks must agree on both
        kept = self.layouts.get(ctx.model)  # the compressor state outlives recompiles of the model's steps
        state = None if self.compress is None else kept.state if kept is not None else CompressionState.for_dim(dim)
        layouts_of(gm).shards = ShardLayout(dim, self.reshard_after_forward, tuple(entries), wire_text,
                                            self.compress, state, self.warmup if self.spec.other != Dense() else 0,
                                            replicas, placed_on, ctx.mesh.size("cp") if sums else 1)
        self.layouts[ctx.model] = layouts_of(gm).shards
        return PassResult(True, {"parameters": len(entries), "ranks": dim.size, "buckets": len(buckets),
                                 "replicas": replicas.size if replicas else 1, "spans": dim.name,
                                 "context_sums_absorbed": len(sums), "float8_gathered": len(float8),
                                 "float8_kept": float8_kept,
                                 "prefetch": self.prefetch, "gather_dtype": str(wire) if wire else None,
                                 "reduce_dtype": str(reduce or wire) if (reduce or wire) else None,
                                 "reshard_after_forward": self.reshard_after_forward,
                                 "gathers": [describe_bucket(b, issued[k], dim.size, E4M3 if b[0][1] in float8
                                                             else wire, reduce or wire,
                                                             {e.name for e in entries if e.requires_grad})
                                             for k, b in enumerate(buckets)]})

    def buckets(self, params: list, apart: set) -> list[list]:
        """Parameters in first-use order, cut into gathers: "auto": one per decoder layer, and one
        per run of parameters outside the layers (the embedding; the final norm and head); a size:
        consecutive parameters up to that many bytes; 0: one per parameter. Never mixing dtypes, nor
        the weights gathered in float8 (`apart`) with others (a layer's then take two gathers)."""
        kind = [(p[1].meta["val"].dtype, p[1] in apart) for p in params]
        if self.bucket == "auto":
            runs, out = 0, {}
            for i, param in enumerate(params):
                runs += i > 0 and layer_of_parameter(param[1]) != layer_of_parameter(params[i - 1][1])
                out.setdefault((runs, kind[i]), []).append(param)
            return list(out.values())
        limit = parse_budget(self.bucket) if self.bucket != 0 else 0
        out: list[list] = []
        size = 0
        for i, param in enumerate(params):
            val = param[1].meta["val"]
            nbytes = val.numel() * val.element_size()
            if out and kind[i] == kind[i - 1] and size + nbytes <= limit:
                out[-1].append(param)
                size += nbytes
                continue
            out.append([param])
            size = nbytes
        return out

    def tag_regather(self, gm: fx.GraphModule) -> PassResult:
        """Recompute each gather in the backward instead of saving what it gathered: the gather,
        the flattening of its shards, its wait and every view or copy of the gathered rows (a
        transposed weight is what a matmul's backward reads)."""
        tagged = 0
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is GATHER:
                pending = [node, *[a for a in node.all_input_nodes if a.op == "call_function"]]
                pending += [a for n in pending[1:] for a in n.all_input_nodes if a.op == "call_function"]
                pending += [u for u in node.users if u.target is c10d.wait_tensor.default]
                pending += shard_casts(node)  # float8 bytes: the backward casts the shards again
                followed = (*CASTS, *FLOAT8_VIEWS) if is_float8(node) else CASTS
                while pending:
                    n = pending.pop()
                    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    pending += [u for u in n.users if is_view(u) or is_copy(u) or u.target in followed]
                tagged += 1
        return PassResult(tagged > 0, {"regathered": tagged})


def precision_policy(policy) -> tuple[torch.dtype | None, torch.dtype | None]:
    """Shard's mixed_precision as (gather dtype, reduce dtype), None where the parameter's own
    dtype is kept; checked against what the pass implements."""
    if policy is None:
        return None, None
    if policy == "bf16":
        return torch.bfloat16, torch.bfloat16
    if not isinstance(policy, MixedPrecisionPolicy):
        raise NotImplementedError(f"Shard(mixed_precision={policy!r}): give None, 'bf16' or a "
                                  "torch.distributed.fsdp.MixedPrecisionPolicy.")
    fields = {f: getattr(policy, f) for f in ("param_dtype", "reduce_dtype")}
    if policy.output_dtype is not None:
        raise NotImplementedError(f"Shard(mixed_precision=...): output_dtype={policy.output_dtype} is not "
                                  "supported (the step returns what the graph computes; cast the output yourself).")
    for name in ("param_dtype", "reduce_dtype"):
        if fields[name] not in (None, *WIRE_DTYPES):
            raise NotImplementedError(f"Shard(mixed_precision=...): {name}={fields[name]} is not supported; give "
                                      "torch.bfloat16, torch.float32 or None (float16 would need loss scaling).")
    gather = None if fields["param_dtype"] in (None, torch.float32) else fields["param_dtype"]
    reduce = fields["reduce_dtype"] or gather  # FSDP2: reduce_dtype None reduces in param_dtype
    return gather, None if reduce is None or (gather is None and reduce == torch.float32) else reduce


def placeholders_first(graph: fx.Graph) -> None:
    """Every placeholder before the first computation, in their order (an earlier rewrite may have
    put computations between them)."""
    body = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if body is not None:
        for node in [n for n in graph.nodes if n.op == "placeholder"]:
            body.prepend(node)


def backward_timeline(ctx: Context):
    """The cost model's live bytes of a backward graph (what the reordering may not raise), or None."""
    model = ctx.cost_model
    if model is None:
        return None
    return lambda gm: model.memory.timeline(schedule_of(gm), set(), frees_inputs=model.backward_frees_inputs)


def shard_dims(shard: "Shard", mesh: ParallelMesh | None) -> tuple[MeshDim, MeshDim | None, Any]:
    """The dimension the parameters are sharded over and, for HSDP, the one their shards are
    replicated over with the 2-D (dp_replicate, dp_shard) DeviceMesh they are placed on: from a 2-D
    DeviceMesh given to the pass, or, given none, from a run mesh whose dp_replicate and dp_shard are
    both above 1. Anything else shards over one dimension (resolve_dim)."""
    spec = shard.mesh
    if hasattr(spec, "mesh_dim_names") and spec.ndim == 2:
        outer, inner = (spec[name] for name in spec.mesh_dim_names)
        replicas = resolve_dim(outer, mesh, "dp_replicate", "the shard pass (HSDP)")
        dim = resolve_dim(inner, mesh, "dp_shard", "the shard pass (HSDP)")
    elif spec is None and mesh is not None and mesh.size("dp_replicate") > 1 and mesh.size("dp_shard") > 1:
        dim, replicas = mesh.dim("dp_shard"), mesh.dim("dp_replicate")
    else:
        return resolve_dim(spec, mesh, "dp_shard", "the shard pass"), None, None
    if shard.compress is not None:
        raise NotImplementedError(f"Shard(compress={shard.compress!r}) with HSDP (dp_replicate {replicas.size} x "
                                  f"dp_shard {dim.size}) is not supported: the replicas' all-reduce is not "
                                  "compressed; shard over one dimension to compress.")
    others = [name for name in ("pp", "tp") if mesh is not None and mesh.size(name) > 1]
    if others:
        raise NotImplementedError(f"Shard: HSDP (dp_replicate {replicas.size} x dp_shard {dim.size}) with "
                                  f"{' and '.join(others)} is not supported; shard without replicas "
                                  "(ParallelMesh.build(dp_shard=..., " + ", ".join(f"{n}=..." for n in others) +
                                  ")) or drop " + " and ".join(others) + ".")
    return dim, replicas, spec if spec is not None else mesh.sub_mesh("dp_replicate", "dp_shard")


def check_hsdp_mesh(shard: "Shard") -> None:
    """A 2-D DeviceMesh given to the pass is HSDP's (dp_replicate, dp_shard), and HSDP reduce-scatters
    uncompressed."""
    spec = shard.mesh
    if not hasattr(spec, "mesh_dim_names") or spec.ndim == 1:
        return
    names = tuple(ALIASES.get(n, n) for n in (spec.mesh_dim_names or ()))
    if spec.ndim != 2 or names != ("dp_replicate", "dp_shard"):
        raise DistributedError(f"Shard(mesh=...): a {spec.ndim}-D DeviceMesh named {spec.mesh_dim_names}; give a "
                               "1-D one to shard over, or a 2-D one named ('dp_replicate', 'dp_shard') for HSDP "
                               "(shard within dp_shard, replicate across dp_replicate).")
    if shard.compress is not None:
        raise NotImplementedError(f"Shard(compress={shard.compress!r}) with HSDP (a 2-D mesh) is not supported: "
                                  "the replicas' all-reduce is not compressed; shard over one dimension to compress.")


def is_copy(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in COPY_PACKETS


def layer_of_parameter(node: fx.Node) -> str | None:
    """The decoder layer a parameter belongs to, by its name (a fused op reading it may span two)."""
    return layer_of_path(input_slot(node).target)


def shard_entry(ctx: Context, node: fx.Node, shape: tuple, bucket: int, dim: MeshDim) -> ShardEntry:
    name = input_slot(node).target
    return ShardEntry(name, shape, padded_rows(shape[0], dim.size), str(node.meta["val"].dtype), bucket,
                      ctx.model.get_parameter(name).requires_grad, local_rows(shape[0], dim.size, dim.rank))
