"""What each rank runs in the shard tests (spawned: these functions must be importable).

Each returns plain tensors and facts (gathered gradients as full tensors); the test process
compares them with single-process references."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import picofx
from picofx.models import real_models, zoo
from picofx.passes import Checkpoint, Shard
from picofx.runtime.shard import local_bytes, memory_per_rank
from picofx.capture.vocabulary import viewed_source
from picofx.testing import op_counts

from overlap_ranks import clear, later_batch, shard


WAIT = torch.ops._c10d_functional.wait_tensor.default


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def gathered_grads(model) -> dict:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def saved_gathers(forward_graph) -> int:
    """How many of the forward graph's outputs (what the backward reads) are gathered parameters."""
    count = 0
    for node in forward_graph.graph.output_node().args[0]:
        source = viewed_source(node) if isinstance(node, torch.fx.Node) else None
        if source is not None and source.target == WAIT and "all_gather" in str(source.args[0].target):
            count += 1
    return count


def row_bytes(model) -> int:
    """One first-dimension row of every parameter: the most padding a rank can hold."""
    return sum(p[0].numel() * p.element_size() for p in model.parameters())


def facts(model) -> dict:
    """Where the parameters and gradients live after a sharded step."""
    params = dict(model.named_parameters())
    return {"dtensor_params": all(isinstance(p, DTensor) for p in params.values()),
            "dtensor_grads": all(isinstance(p.grad, DTensor) for p in params.values() if p.grad is not None),
            "placements": sorted({str(p.placements) for p in params.values() if isinstance(p, DTensor)}),
            "local_bytes": local_bytes(model),
            "local_grad_bytes": sum(p.grad.to_local().numel() * 4 for p in params.values() if p.grad is not None)}


def reference_llama_checks(rank: int, world: int, batch: int, checkpoint_dir: str) -> dict:
    """Shard on the reference LLaMA: one step (loss, gathered gradients, where they live), the
    graphs' collectives; AdamW steps with gradient clipping (gathered parameters); the DCP round
    trip; reshard_after_forward=False on a fresh model."""
    z = zoo.build("llama-tiny", batch=batch)
    out = {"full_bytes": local_bytes(z.model), "row_bytes": row_bytes(z.model),
           "names": [n for n, _ in z.model.named_parameters()]}
    opt = picofx.optimize(z.model, shard(z.example_inputs, rank, world), [Shard()], backend="eager",
                          loss_fn=z.loss_fn)
    out.update(graph_facts(opt))
    out["loss"] = opt.forward_backward(**shard(z.example_inputs, rank, world))
    out["grads"] = gathered_grads(z.model)
    out.update(facts(z.model))
    out["opt_names"] = [n for n, _ in opt.named_parameters()]
    clear(z.model)  # accumulation: no_sync is accepted; each backward still reduce-scatters into the shards
    with opt.no_sync():
        opt.forward_backward(**shard(z.example_inputs, rank, world))
    opt.forward_backward(**shard(later_batch(z.example_inputs, 3), rank, world))
    out["accumulated"] = gathered_grads(z.model)
    out.update(adamw_steps(opt, z, rank, world))
    out["state_dict"] = round_trip(opt, checkpoint_dir, rank)
    out["memory"] = memory_per_rank(opt, **shard(z.example_inputs, rank, world))
    out["kept"] = kept_gathers_checks(rank, world, batch)
    out["composed"] = composed_checks(rank, world, batch)
    out["mixed"] = composed_checks(rank, world, batch, Shard(mixed_precision="bf16"))
    return out


COMPOSED = ["fuse", "precision", Checkpoint(budget=0.995)]  # a tight budget: sharding already saves the weights
COMPOSED_SEQ = 64  # at 32 tokens no recomputation lowers the peak


def composed_checks(rank: int, world: int, batch: int, sharding=Shard()) -> dict:
    """fuse + precision + checkpoint, then shard: the gathered gradients of the same optimized step,
    and the dtypes its collectives move."""
    z = zoo.build("llama-tiny", batch=batch, seq=COMPOSED_SEQ)
    opt = picofx.optimize(z.model, shard(z.example_inputs, rank, world), [*COMPOSED, sharding], backend="eager",
                          loss_fn=z.loss_fn)
    return {"loss": opt.forward_backward(**shard(z.example_inputs, rank, world)), "grads": gathered_grads(z.model),
            "passes": sorted({r.name for r in opt.report.records if r.changed}),
            "gathered": collective_dtypes(opt.graphs["forward"], "all_gather"),
            "reduced": collective_dtypes(opt.graphs["backward"], "reduce_scatter"),
            "param_dtypes": sorted({str(p.dtype) for p in z.model.parameters()})}


def collective_dtypes(gm, kind: str) -> list[str]:
    return sorted({str(n.meta["val"].dtype) for n in gm.graph.nodes if kind in str(n.target)})


def collective_order(gm) -> list[str]:
    """The forward graph's gathers and waits in order ("gather", "wait")."""
    return ["gather" if "all_gather" in str(n.target) else "wait" for n in gm.graph.nodes
            if n.op == "call_function" and ("all_gather" in str(n.target) or n.target == WAIT)]


MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def collective_namespaces(opt) -> list[str]:
    """The operator namespaces of every collective and wait in the graphs the step runs (the
    partitioned forward and backward; the joint graph, as captured, holds autograd's)."""
    return sorted({n.target.namespace for gm in (opt.graphs["forward"], opt.graphs["backward"]) for n in gm.graph.nodes
                   if n.op == "call_function" and "c10d" in getattr(n.target, "namespace", "")})


def scatters_overlapped(backward) -> list[int]:
    """Per reduce-scatter of the backward graph, the matmuls issued after it and before its wait."""
    nodes = list(backward.graph.nodes)
    out = []
    for i, node in enumerate(nodes):
        if node.op == "call_function" and "reduce_scatter" in str(node.target):
            wait = nodes.index(next(u for u in node.users if u.target == WAIT))
            out.append(sum(n.target in MATMULS for n in nodes[i + 1:wait]))
    return out


def graph_facts(opt) -> dict:
    return {"forward_order": collective_order(opt.graphs["forward"]), "forward_ops": op_counts(opt.graphs["forward"]),
            "backward_ops": op_counts(opt.graphs["backward"]), "namespaces": collective_namespaces(opt),
            "scatters_overlapped": scatters_overlapped(opt.graphs["backward"]),
            "saved_gathers": saved_gathers(opt.graphs["forward"]),
            "notes": {f"{r.stage.value}.{r.graph_role}": r.notes for r in opt.report.records if r.name == "shard"}}


def adamw_steps(opt, z, rank: int, world: int, steps: int = 3) -> dict:
    """AdamW over the sharded parameters, clipping the gradient norm first (as a training loop does)."""
    optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-3)
    norms = []
    for step in range(steps):
        clear(z.model)
        opt.forward_backward(**shard(later_batch(z.example_inputs, step + 5), rank, world))
        norms.append(full(torch.nn.utils.clip_grad_norm_(opt.parameters(), max_norm=1.0)))
        optimizer.step()
    state_bytes = sum(v.to_local().numel() * v.element_size() for s in optimizer.state.values()
                      for v in s.values() if isinstance(v, DTensor))
    return {"params": {n: full(p) for n, p in z.model.named_parameters()}, "norms": torch.stack(norms),
            "optimizer_state_bytes": state_bytes}


def round_trip(opt, checkpoint_dir: str, rank: int) -> dict | None:
    """get_model_state_dict + dcp.save from every rank; rank 0 converts the checkpoint to a torch
    file and loads it into a plain model (strict=True); returns that model's state_dict there."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save(get_model_state_dict(opt), checkpoint_id=f"{checkpoint_dir}/dcp")
    dist.barrier()
    if rank != 0:
        return None
    dcp_to_torch_save(f"{checkpoint_dir}/dcp", f"{checkpoint_dir}/model.pt")
    plain = zoo.build("llama-tiny", seed=7).model  # other values: the load must replace all of them
    plain.load_state_dict(torch.load(f"{checkpoint_dir}/model.pt"), strict=True)
    return {k: v.clone() for k, v in plain.state_dict().items()}


def kept_gathers_checks(rank: int, world: int, batch: int) -> dict:
    """reshard_after_forward=False: the backward reads the forward's gathered parameters; one
    gather per parameter, each issued just before its first use."""
    z = zoo.build("llama-tiny", batch=batch)
    opt = picofx.optimize(z.model, shard(z.example_inputs, rank, world),
                          [Shard(reshard_after_forward=False, bucket=0, prefetch=0)], backend="eager",
                          loss_fn=z.loss_fn)
    return {**graph_facts(opt), "loss": opt.forward_backward(**shard(z.example_inputs, rank, world)),
            "grads": gathered_grads(z.model)}


def hf_llama_checks(rank: int, world: int, batch: int, vocab_size: int) -> dict:
    """Shard with fuse on Hugging Face Llama whose vocabulary does not divide by the ranks and
    whose head shares the embedding's weight."""
    z = zoo.build("hf-llama-tiny", batch=batch, vocab_size=vocab_size, tie_word_embeddings=True)
    full_bytes, rows = local_bytes(z.model), row_bytes(z.model)
    opt = picofx.optimize(z.model, shard(z.example_inputs, rank, world), ["fuse", Shard()], backend="eager")
    out = {"loss": opt.forward_backward(**shard(z.example_inputs, rank, world)), "grads": gathered_grads(z.model),
           "full_bytes": full_bytes, "row_bytes": rows, **facts(z.model), **graph_facts(opt)}
    out["local_rows"] = {n: p.to_local().shape[0] for n, p in z.model.named_parameters()}
    out["still_tied"] = z.model.lm_head.weight is z.model.model.embed_tokens.weight
    clear(z.model)  # a new sequence length: captured again from the sharded model
    shorter = {k: v[:, :16].contiguous() for k, v in z.example_inputs.items()}
    out["recaptured_loss"] = opt.forward_backward(**shard(shorter, rank, world))
    out["recaptured_grads"] = gathered_grads(z.model)
    out["still_sharded"] = facts(z.model)["local_bytes"] == out["local_bytes"]
    qwen = real_models.hf_model("qwen2", batch=batch)  # q/k/v biases: 1-D shards of their own
    opt = picofx.optimize(qwen.model, shard(qwen.example_inputs, rank, world), ["fuse", Shard()], backend="eager")
    out["qwen2_loss"] = opt.forward_backward(**shard(qwen.example_inputs, rank, world))
    out["qwen2_grads"] = gathered_grads(qwen.model)
    return out


def mismatched_layout(rank: int, world: int) -> float:
    """Rank 1 freezes one parameter: every rank must refuse before any gather."""
    z = zoo.build("llama-tiny", batch=2)
    if rank == 1:
        z.model.get_parameter("decoder_layers.1.mlp.up_proj.weight").requires_grad_(False)
    picofx.optimize(z.model, z.example_inputs, [Shard()], backend="eager", loss_fn=z.loss_fn)


def inductor_checks(rank: int, world: int, batch: int) -> dict:
    """Shard under Inductor: loss, gradients and the generated code's collectives."""
    from torch._inductor.utils import run_and_get_code

    z = zoo.build("llama-tiny", batch=batch)
    local = shard(z.example_inputs, rank, world)
    opt, code = run_and_get_code(lambda: picofx.optimize(z.model, local, ["fuse", Shard()], backend="inductor",
                                                         loss_fn=z.loss_fn))
    return {"loss": opt.forward_backward(**local), "grads": gathered_grads(z.model), "code": code,
            **graph_facts(opt)}


def hsdp_checks(rank: int, world: int, batch: int, checkpoint_dir: str) -> dict:
    """HSDP on 4 ranks, dp_replicate 2 x dp_shard 2 (the run's mesh): one step's loss and gathered
    gradients, the graphs' collectives, where the parameters live, AdamW steps with clipping, the
    DCP round trip; the same through Shard(mesh=<the 2-D DeviceMesh>); what it refuses."""
    from picofx.parallel import ParallelMesh

    mesh = ParallelMesh.build(dp_replicate=2, dp_shard=2)
    z = zoo.build("llama-tiny", batch=batch)
    local = shard(z.example_inputs, rank, world)
    opt = picofx.optimize(z.model, local, [Shard()], backend="eager", loss_fn=z.loss_fn, mesh=mesh)
    out = {"loss": opt.forward_backward(**local), "grads": gathered_grads(z.model), **graph_facts(opt), **facts(z.model),
           "mesh_dims": sorted({p.device_mesh.mesh_dim_names for p in z.model.parameters()}),
           "full_bytes": local_bytes(zoo.build("llama-tiny").model)}
    out.update(adamw_steps(opt, z, rank, world, steps=2))
    out["state_dict"] = round_trip(opt, checkpoint_dir, rank)
    given = zoo.build("llama-tiny", batch=batch)
    opt = picofx.optimize(given.model, local, [Shard(mesh=mesh.sub_mesh("dp_replicate", "dp_shard"))],
                          backend="eager", loss_fn=given.loss_fn)
    out["given_loss"], out["given_grads"] = opt.forward_backward(**local), gathered_grads(given.model)
    try:
        picofx.optimize(zoo.build("llama-tiny").model, local, [Shard(compress="bf16")], backend="eager",
                        loss_fn=z.loss_fn, mesh=mesh)
    except Exception as e:  # noqa: BLE001 (its message is what the test reads)
        out["compress_refused"] = str(e)
    return out


def with_pipeline(rank: int, world: int) -> dict:
    """4 ranks: 2 pipeline stages x 2 sharded data-parallel ranks, both replicas on one batch."""
    from picofx.passes import Pipeline

    z = zoo.build("llama-tiny", batch=4)
    opt = picofx.optimize(z.model, z.example_inputs, [Pipeline(stages=2, microbatches=2), Shard()],
                          backend="eager", loss_fn=z.loss_fn)
    loss = opt.forward_backward(**dict(z.example_inputs))
    held = dict(opt.named_parameters())
    return {"loss": loss.detach(), "grads": {n: full(p.grad) for n, p in held.items()},
            "sharded": all(isinstance(p, DTensor) for p in held.values()),
            "local_bytes": sum(p.to_local().numel() * p.element_size() for p in held.values()),
            "whole_bytes": sum(p.numel() * p.element_size() for p in held.values())}


FP32_REDUCE = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def mixed_precision_checks(rank: int, world: int, batch: int) -> dict:
    """MixedPrecisionPolicy(bf16 parameters, fp32 reduction) on picofx's shard (with precision, so
    the step computes in bf16 as FSDP2's bf16 parameters do) and on FSDP2 (fully_shard per decoder
    layer and the root, eager), same batches: gathered gradients, the collectives' dtypes, the
    report's per-bucket and per-rank memory figures."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from picofx.runtime.shard import memory_per_rank

    policy = MixedPrecisionPolicy(**FP32_REDUCE)
    z = zoo.build("llama-tiny", batch=batch)
    local = shard(z.example_inputs, rank, world)
    opt = picofx.optimize(z.model, local, ["precision", Shard(mixed_precision=policy)], backend="eager",
                          loss_fn=z.loss_fn)
    out = {"loss": opt.forward_backward(**local), "grads": gathered_grads(z.model),
           "gathered": collective_dtypes(opt.graphs["forward"], "all_gather"),
           "reduced": collective_dtypes(opt.graphs["backward"], "reduce_scatter"),
           "param_dtypes": sorted({str(p.dtype) for p in z.model.parameters()}),
           "notes": {f"{r.stage.value}.{r.graph_role}": r.notes for r in opt.report.records if r.name == "shard"}}
    optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-3)
    optimizer.step()  # its state exists: the memory figures count it
    out["memory"] = memory_per_rank(opt, **local, optimizer=optimizer)
    out["report"] = str(opt.report)
    reference = zoo.build("llama-tiny", batch=batch).model
    for layer in reference.decoder_layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(reference, mp_policy=policy)
    z.loss_fn(reference(local["input_ids"]), local["labels"]).backward()
    out["fsdp_grads"] = gathered_grads(reference)
    return out
