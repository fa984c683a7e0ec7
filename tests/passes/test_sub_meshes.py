"""Sub-meshes of one DeviceMesh given to the passes (`Shard(mesh=mesh["dp"]), TensorParallel(mesh=
mesh["tp"])`, as FSDP2 and DTensor users write them) with no optimize(..., mesh=...): the run's mesh
is the one they were sliced from (issue 48)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from picofx.api import run_mesh
from picofx.errors import DistributedError
from picofx.models import zoo
from picofx.parallel.mesh import one_process_group
from picofx.passes import ContextParallel, Overlap, Shard, TensorParallel

import sub_mesh_ranks
from spawn_ranks import run_scenarios


def test_the_run_mesh_is_the_one_the_passes_sub_meshes_were_sliced_from():
    made = not dist.is_initialized()
    one_process_group()
    try:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "cp", "tp"))
        other = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        model = torch.nn.Linear(2, 2)
        passes = [Shard(mesh=mesh["dp"]), Overlap(group=mesh["dp"]), ContextParallel(mesh=mesh["cp"]),
                  TensorParallel(mesh=mesh["tp"])]
        found = run_mesh(None, passes, model)
        assert found is not None and found.device_mesh is mesh
        assert dict(found.sizes) == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
        named_otherwise = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicas", "sequence"))
        assert run_mesh(None, [ContextParallel(mesh=named_otherwise["sequence"])], model).device_mesh is None
        with pytest.raises(DistributedError, match="sub-meshes of different DeviceMeshes"):
            run_mesh(None, [Shard(mesh=mesh["dp"]), TensorParallel(mesh=other["tp"])], model)
    finally:
        if made:
            dist.destroy_process_group()


@pytest.mark.slow
def test_shard_and_tensor_parallel_on_sub_meshes_equal_one_process():
    ranks = run_scenarios([(sub_mesh_ranks.shard_and_tensor_parallel,)], 4, timeout=1200,
                          collective_timeout=300)["shard_and_tensor_parallel"]
    z = zoo.build("llama-tiny", batch=4)
    batch = dict(z.example_inputs)
    loss = z.loss_fn(z.model(batch["input_ids"]), batch["labels"])
    loss.backward()
    torch.testing.assert_close(torch.stack([r["loss"] for r in ranks]).mean(), loss.detach(), rtol=1e-5, atol=1e-6)
    for rank in ranks:
        for name, p in z.model.named_parameters():
            torch.testing.assert_close(rank["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert ranks[0]["placements"]["decoder_layers.0.attention.out_proj.weight"] == "[Shard(dim=0), Shard(dim=1)]"
