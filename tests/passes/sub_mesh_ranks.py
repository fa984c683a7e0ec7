"""What each of four gloo ranks runs for tests/passes/test_sub_meshes.py: the passes given sub-meshes
of one DeviceMesh, as FSDP2 and DTensor users write them, and no mesh on optimize."""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import picofx
from picofx.models import zoo
from picofx.passes import Shard, TensorParallel


def shard_and_tensor_parallel(rank: int, world: int) -> dict:
    """dp 2 x tp 2: each dp rank its half of a batch of 4; one step."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    z = zoo.build("llama-tiny", batch=4)
    half = {k: v.chunk(2)[dp].contiguous() for k, v in dict(z.example_inputs).items()}
    opt = picofx.optimize(z.model, half, [Shard(mesh=mesh["dp"]), TensorParallel(mesh=mesh["tp"])], backend="eager",
                          loss_fn=z.loss_fn)
    loss = opt.forward_backward(**half)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in z.model.named_parameters()}
    return {"loss": torch.as_tensor(loss).detach(), "grads": grads,
            "placements": {n: str(list(p.placements)) for n, p in z.model.named_parameters()}}
