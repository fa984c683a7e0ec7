"""What each of two gloo ranks runs for tests/passes/test_tensor_parallel.py: every rank gets the
same full batch; results go back to the test process, which compares them."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import picofx
from picofx.models import real_models, zoo
from picofx.capture.vocabulary import layer_of_path, traced_module_path, viewed_source
from picofx.passes import TensorParallel

c10d = torch.ops._c10d_functional
ISSUES = (c10d.all_reduce.default, c10d.all_reduce_.default,  # Inductor's graphs: in place where it may
          c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
OPERATORS = ("tp_reduce", "tp_copy", "tp_max", "sp_gather", "sp_scatter")  # picofx.parallel.collectives'


def is_gather(node: torch.fx.Node) -> bool:
    """The wait of a sequence-parallel all-gather."""
    return node.target is c10d.wait_tensor.default and node.args[0].target is c10d.all_gather_into_tensor.default


def collectives(graph: torch.fx.Graph) -> dict:
    """What a graph that runs holds of communication: the picofx operators left in it (by name),
    its functional collectives, those without a wait, the waits with a node other than waits
    between them and their first reader, and the collectives with a matmul between their issue
    and their wait."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    issues = [n for n in nodes if n.target in ISSUES]
    waits = {i: [u for u in i.users if u.target is c10d.wait_tensor.default] for i in issues}
    return {"picofx": sorted({n.target.__name__ for n in nodes if getattr(n.target, "namespace", None) == "picofx"
                              and n.target.__name__.split(".")[0] in OPERATORS}),
            "issues": len(issues), "unwaited": sum(1 for w in waits.values() if not w),
            "early waits": sum(1 for w in waits.values() for wait in w if any(  # another node before its reader
                n.target is not c10d.wait_tensor.default
                for n in nodes[order[wait] + 1:order[min(wait.users, key=order.get)]])),
            "under a matmul": sum(1 for i, w in waits.items() if w and any(
                n.target in MATMULS for n in nodes[order[i] + 1:order[min(w, key=order.get)]]))}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def one_step(z: zoo.ZooModel, backend: str = "eager", **options) -> dict:
    opt = picofx.optimize(z.model, z.example_inputs, [TensorParallel(**options)], backend=backend, loss_fn=z.loss_fn)
    batch = dict(z.example_inputs)
    out = opt(**batch)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    placements = {n: str(p.placements[0]) if isinstance(p, DTensor) else "plain" for n, p in z.model.named_parameters()}
    local = {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for n, p in z.model.named_parameters()}
    widest = max((n.meta["val"].shape[-1] for n in opt.graph_module.graph.nodes
                  if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 1), default=0)
    gathers = {role: sum(1 for n in opt.graphs[role].graph.nodes if is_gather(n)) for role in ("forward", "backward")}
    saved = [viewed_source(n, through_copies=True) for n in opt.graphs["forward"].graph.output_node().args[0]
             if isinstance(n, torch.fx.Node)]
    return {"loss": loss.detach(), "grads": {n: _full(p.grad) for n, p in z.model.named_parameters()},
            "gathers": gathers, "regathered": sum(r.notes.get("regathered", 0) for r in opt.report.records
                                                  if r.name == "tensor_parallel"),
            "saved_gathers": sum(1 for n in saved if is_gather(n) and layer_of_path(traced_module_path(n))),
            "collectives": {role: collectives(opt.graphs[role].graph) for role in ("forward", "backward")},
            "placements": placements, "local_shapes": local, "widest": widest, "notes": next(
                r.notes for r in opt.report.records if r.name == "tensor_parallel"),
            "plan": opt.report.sections["tensor_parallel"]}


def llama(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    return {"reference": one_step(zoo.build("llama-tiny")), "hf": one_step(real_models.hf_model("llama")),
            "qwen2": one_step(real_models.hf_model("qwen2")),
            "tied": one_step(real_models.hf_model("llama", tie_word_embeddings=True)),
            "sequence": one_step(zoo.build("llama-tiny"), sequence_parallel=True),
            "hf sequence": one_step(real_models.hf_model("llama"), sequence_parallel=True)}


def adamw_and_checkpoint(rank: int, world: int, directory: str) -> dict:
    """Three AdamW steps with gradient clipping, then a DCP checkpoint from every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    z = zoo.build("llama-tiny")
    opt = picofx.optimize(z.model, z.example_inputs, [TensorParallel()], backend="eager", loss_fn=z.loss_fn)
    optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-3)
    for _ in range(3):
        opt(**dict(z.example_inputs)).backward()
        torch.nn.utils.clip_grad_norm_(opt.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dcp.save(get_model_state_dict(z.model), checkpoint_id=directory)
    return {"parameters": {n: _full(p) for n, p in z.model.named_parameters()}}



def with_fuse(rank: int, world: int, backend: str) -> dict:
    """tensor_parallel then fuse: the fused kernels run on each rank's pieces."""
    z = zoo.build("llama-tiny")
    opt = picofx.optimize(z.model, z.example_inputs, [TensorParallel(), "fuse"], backend=backend, loss_fn=z.loss_fn)
    loss = opt(**dict(z.example_inputs))
    loss.backward()
    fused = next(r.notes for r in opt.report.records if r.name == "fuse")
    return {"loss": loss.detach(), "grads": {n: _full(p.grad) for n, p in z.model.named_parameters()},
            "fused": {k: v for k, v in fused.items() if isinstance(v, int)}}


def with_data_parallel(rank: int, world: int) -> dict:
    """4 ranks as 2 data-parallel replicas x 2 tensor-parallel ranks: each replica its own batch,
    gradients split over tp and averaged over the replicas (pass overlap) inside the backward; then
    two micro-batches accumulated, the first under no_sync."""
    from picofx.parallel import ParallelMesh

    mesh = ParallelMesh.build(dp_replicate=2, tp=2)
    replica = mesh.dim("dp_replicate").rank
    z = zoo.build("llama-tiny", batch=2, seed=0)
    batch = {k: v.roll(replica * 3, dims=-1).contiguous() for k, v in dict(z.example_inputs).items()}
    opt = picofx.optimize(z.model, batch, [TensorParallel(), "overlap"], backend="eager", loss_fn=z.loss_fn,
                          mesh=mesh)
    loss = opt(**batch)
    loss.backward()
    grads = {n: _full(p.grad) for n, p in z.model.named_parameters()}
    z.model.zero_grad(set_to_none=True)  # DDP's accumulation: one backward under no_sync, then one synced
    with opt.no_sync():
        opt(**batch).backward()
    opt(**{k: v.roll(1, dims=-1).contiguous() for k, v in batch.items()}).backward()
    return {"loss": loss.detach(), "replica": replica, "grads": grads,
            "accumulated": {n: _full(p.grad) for n, p in z.model.named_parameters()}}


def with_shard(rank: int, world: int, directory: str) -> dict:
    """4 ranks as dp_shard 2 x tp 2: each dp rank its half of the batch, parameters 2-D DTensors.
    Shard listed before TensorParallel (each on its mesh dimension): one step. Then the same passes
    and fuse in another order than they run in: one step, three AdamW steps with clipping, a DCP
    checkpoint."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from overlap_ranks import later_batch, shard
    from picofx.parallel import ParallelMesh
    from picofx.passes import Shard
    from picofx.runtime.shard import local_bytes

    mesh = ParallelMesh.build(dp_shard=2, tp=2)
    dp = mesh.dim("dp_shard")
    out = {}
    for order, passes in (("shard first", [Shard(mesh="dp_shard"), TensorParallel(mesh="tp")]),
                          ("fuse first", ["fuse", Shard(), TensorParallel()])):
        z = zoo.build("llama-tiny", batch=4)
        out.setdefault("whole_bytes", local_bytes(z.model))
        opt = picofx.optimize(z.model, shard(z.example_inputs, dp.rank, 2), passes, backend="eager",
                              loss_fn=z.loss_fn, mesh=mesh)
        out[order] = {"loss": opt.forward_backward(**shard(z.example_inputs, dp.rank, 2)),
                      "grads": {n: _full(p.grad) for n, p in z.model.named_parameters()},
                      "ran": list(dict.fromkeys(r.name for r in opt.report.records)),
                      "pass order": opt.report.sections.get("pass order"),
                      "schedule": [r.notes["schedule"] for r in opt.report.records
                                   if r.name == "shard" and "schedule" in r.notes]}
    out["placements"] = {n: str(list(p.placements)) for n, p in z.model.named_parameters()}
    out["local_bytes"] = local_bytes(z.model)
    optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-3)
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        opt.forward_backward(**shard(later_batch(z.example_inputs, step + 5), dp.rank, 2))
        torch.nn.utils.clip_grad_norm_(opt.parameters(), max_norm=1.0)
        optimizer.step()
    out["parameters"] = {n: _full(p) for n, p in z.model.named_parameters()}
    dcp.save(get_model_state_dict(z.model), checkpoint_id=directory)
    dist.barrier()
    return out


def with_pipeline(rank: int, world: int) -> dict:
    """4 ranks as pp 2 x tp 2, tensor_parallel listed first: the pipeline cuts first, then each
    stage's graph is split over its tp ranks, both on the whole batch."""
    from picofx.parallel import ParallelMesh
    from picofx.passes import Pipeline

    mesh = ParallelMesh.build(pp=2, tp=2)
    z = zoo.build("llama-tiny", batch=4)
    opt = picofx.optimize(z.model, z.example_inputs, [TensorParallel(), Pipeline(stages=2, microbatches=2)],
                          backend="eager", loss_fn=z.loss_fn, mesh=mesh)
    loss = opt.forward_backward(**dict(z.example_inputs))
    held = dict(opt.named_parameters())
    return {"loss": loss.detach(), "grads": {n: _full(p.grad) for n, p in held.items()},
            "placed": all(isinstance(p, DTensor) for p in held.values()),
            "pass order": opt.report.sections.get("pass order"),
            "local_bytes": sum(p.to_local().numel() * p.element_size() for p in held.values()),
            "whole_bytes": sum(p.numel() * p.element_size() for p in held.values())}


def uneven(rank: int, world: int) -> dict:
    """tp=4 on the reference LLaMA's 4 query heads over 2 key/value heads (k/v projections whole on
    every rank), and on a vocabulary of 257 (table and head padded to 260), untied and tied."""
    return {"kv": one_step(zoo.build("llama-tiny")), "vocab": one_step(zoo.build("llama-tiny", vocab_size=257)),
            "tied vocab": one_step(real_models.hf_model("llama", vocab_size=257, tie_word_embeddings=True))}


def three_dimensional(rank: int, world: int) -> dict:
    """8 ranks as pp 2 x dp_shard 2 x tp 2: each replica its half of the batch, each stage's graph
    split over its tp ranks and its parameters sharded again over dp_shard (2-D DTensors)."""
    from picofx.parallel import ParallelMesh
    from picofx.passes import Pipeline, Shard

    mesh = ParallelMesh.build(pp=2, dp_shard=2, tp=2)
    z = zoo.build("llama-tiny", batch=8)
    replica = mesh.dim("dp_shard").rank
    half = {k: v.chunk(2)[replica].contiguous() for k, v in dict(z.example_inputs).items()}
    opt = picofx.optimize(z.model, half, [Pipeline(stages=2, microbatches=2), TensorParallel(), Shard()],
                          backend="eager", loss_fn=z.loss_fn, mesh=mesh)
    loss = opt.forward_backward(**half)
    held = dict(opt.named_parameters())
    return {"loss": loss.detach(), "grads": {n: _full(p.grad) for n, p in held.items()},
            "placements": {n: len(p.placements) for n, p in held.items() if isinstance(p, DTensor)},
            "local_bytes": sum(p.to_local().numel() * p.element_size() for p in held.values()),
            "whole_bytes": sum(p.numel() * p.element_size() for p in held.values())}


def awkward_shapes(rank: int, world: int) -> dict:
    """tp=2 on shapes it cannot split evenly: an MLP width it does not divide (refused, with how
    long that took), and heads it does not divide (3), or whose key/value groups it would cut (6
    query heads over 3 key/value heads): those run, with what cannot be split kept whole."""
    import time

    from picofx.errors import PassError

    out = {}
    start = time.perf_counter()
    try:
        one_step(zoo.build("llama-tiny", intermediate_size=97))
    except PassError as e:
        out["rows"] = str(e)
    out["rows seconds"] = time.perf_counter() - start
    out["heads"] = one_step(zoo.build("llama-tiny", **AWKWARD_HEADS["heads"]))
    out["kv groups"] = one_step(zoo.build("llama-tiny", **AWKWARD_HEADS["kv groups"]))
    return out


AWKWARD_HEADS = {"heads": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3),
                 "kv groups": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)}


def inductor(rank: int, world: int) -> dict:
    """Under Inductor: tensor parallel, sequence parallel without and with async_overlap, and the
    code Inductor generated for the first."""
    from torch._inductor.utils import run_and_get_code

    out = {}
    out["tp"], code = run_and_get_code(lambda: one_step(zoo.build("llama-tiny"), "inductor"))
    out["code"] = "\n".join(code)
    out["sequence"] = one_step(zoo.build("llama-tiny"), "inductor", sequence_parallel=True, async_overlap=False)
    out["async"] = one_step(zoo.build("llama-tiny"), "inductor", sequence_parallel=True)
    return out
