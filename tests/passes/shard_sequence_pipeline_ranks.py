"""What each of 8 gloo ranks runs for tests/passes/test_shard_sequence_pipeline.py: the reference
LLaMA on pp 2 x dp_shard 2 x tp 2 with Shard, sequence-parallel (async) TensorParallel and a 1F1B
Pipeline; one training step. Each rank sends back its loss, its stage's gradients (whole), and the
collectives its stage's compiled graphs issue, in order, each named by the mesh dimension it spans."""
from __future__ import annotations

from torch.distributed.tensor import DTensor

import picofx
from picofx.models import zoo
from picofx.parallel import ParallelMesh
from picofx.passes import Pipeline, Shard, TensorParallel

BATCH = 16  # 2 replicas of 8 sequences, each 4 micro-batches of 2
MESH = {"pp": 2, "dp_shard": 2, "tp": 2}


def tiny():
    return zoo.build("llama-tiny", batch=BATCH)


def collectives(gm, dims: dict[str, str]) -> list[str]:
    """`gm`'s collectives in graph order as "op@dimension" (a group name no dimension has: as is)."""
    out = []
    for node in gm.graph.nodes:
        target = str(node.target)
        if node.op == "call_function" and "_c10d_functional" in target and "wait_tensor" not in target:
            group = [a for a in node.args if isinstance(a, str)][-1]
            out.append(f"{target.split('.')[-2]}@{dims.get(group, group)}")
    return out


def step(rank: int, world: int) -> dict:
    mesh = ParallelMesh.build(**MESH)
    replica = mesh.dim("dp_shard")
    z = tiny()
    batch = {k: v.chunk(replica.size)[replica.rank].contiguous() for k, v in z.example_inputs.items()}
    passes = [Pipeline(stages=2, microbatches=4, schedule="1F1B"), Shard(),
              TensorParallel(sequence_parallel=True, async_overlap=True)]
    opt = picofx.optimize(z.model, batch, passes, backend="eager", loss_fn=z.loss_fn, mesh=mesh)
    dims = {mesh.dim(d).group_name: d for d in MESH}
    issued = {f"stage{index} {role}": collectives(gm, dims)
              for index, graphs in opt.pipeline.stage_graphs.items()
              for role, gm in graphs.items() if role in ("forward", "backward")}
    loss = opt.forward_backward(**batch)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in opt.named_parameters() if p.grad is not None}
    return {"loss": loss.detach().clone(), "grads": grads, "issued": issued,
            "stage": mesh.dim("pp").rank, "replica": replica.rank}


def one_process() -> dict:
    """Loss and gradients of the plain model on the full batch."""
    z = tiny()
    inputs = {k: v for k, v in z.example_inputs.items() if k != "labels"}
    loss = z.loss_fn(z.model(**inputs), z.example_inputs["labels"])
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.detach().clone() for n, p in z.model.named_parameters()}}
