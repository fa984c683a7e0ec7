"""What each of 4 ranks runs in the float8-gather tests of the shard pass on a 2-D mesh (spawned:
importable functions): Shard beside tensor parallelism (with and without sequence parallelism), HSDP,
and Shard over 4 ranks with a compressed reduce-scatter. Each returns plain tensors and facts; the
test process compares them with one process running the same float8 layers."""
from __future__ import annotations

import warnings

import torch
from torch.distributed.tensor import DTensor

import picofx
from picofx.models import zoo
from picofx.parallel import ParallelMesh
from picofx.passes import Precision, Shard, TensorParallel

import shard_float8_ranks
from overlap_ranks import shard

# The attention projections: float8 under tp=2 too (the MLP, 88 wide a tp rank, stays high precision
# there; the output projection, in tp's loss, has no module path), so every scenario and the one
# process run the same layers in float8.
LAYERS = ("decoder_layers.*.attention.*",)
BATCH = 8  # 4 data-parallel ranks of 2 sequences of 24: 48 tokens, a multiple of the kernels' 16


def float8_model():
    return zoo.reference_llama("tiny", batch=BATCH, seq=24)


def precision() -> Precision:
    return Precision(dtype="fp32", float8="tensorwise", float8_layers=LAYERS)


def replica(mesh: ParallelMesh) -> tuple[int, int]:
    """(this rank's data-parallel replica, how many): dp_replicate outer, dp_shard inner."""
    inner, outer = mesh.dim("dp_shard"), mesh.dim("dp_replicate")
    return outer.rank * inner.size + inner.rank, outer.size * inner.size


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def mesh_step(rank: int, world: int, sizes: dict, tp: dict | None = None, **shard_options) -> dict:
    """One step on ParallelMesh.build(**sizes): the loss, whole gradients, the float8 weights the
    forward's matmuls read, the shard pass's notes and the forward graph's all-reduces."""
    mesh = ParallelMesh.build(**sizes)
    index, replicas = replica(mesh)
    z = float8_model()
    inputs = shard(z.example_inputs, index, replicas)
    passes = [precision(), Shard(**shard_options)] + ([TensorParallel(**tp)] if tp is not None else [])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Precision\(float8=...\) on the CPU")
        opt = picofx.optimize(z.model, inputs, passes, backend="eager", loss_fn=z.loss_fn, mesh=mesh)
    with shard_float8_ranks.ForwardWeights() as weights:
        loss = opt.forward_backward(**inputs)
    notes = next(r.notes for r in opt.report.records if r.name == "shard" and "gathers" in r.notes)
    return {"loss": loss.detach(), "replica": index, "replicas": replicas, "weights": weights.seen,
            "grads": {n: whole(p.grad) for n, p in opt.named_parameters() if p.grad is not None},
            "float8_gathered": notes["float8_gathered"], "float8_kept": notes["float8_kept"]}


def tensor_parallel(rank: int, world: int) -> dict:
    return mesh_step(rank, world, dict(dp_shard=2, tp=2), tp={})


def sequence_parallel(rank: int, world: int) -> dict:
    return mesh_step(rank, world, dict(dp_shard=2, tp=2), tp=dict(sequence_parallel=True))


def hsdp(rank: int, world: int) -> dict:
    return mesh_step(rank, world, dict(dp_replicate=2, dp_shard=2))


def compressed_bf16(rank: int, world: int) -> dict:
    return mesh_step(rank, world, dict(dp_shard=4), compress="bf16")
