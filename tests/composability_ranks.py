"""What each gloo rank runs for tests/test_composability.py: every cell of one world size of the
composability table (picofx.manager.combinations), one after another in one spawned group.

Per cell a rank builds the tiny reference LLaMA (same seed on every rank), takes its data-parallel
replica's slice of the full batch, optimizes with the cell's passes on the cell's mesh, runs one
training step and sends back the loss and its held parameters' gradients, whole (DTensor pieces
gathered), or the error the cell raised. The test process compares them with one process."""
from __future__ import annotations

import time

import torch
from torch.distributed.tensor import DTensor

import picofx
from picofx.manager.combinations import Cell
from picofx.models import zoo
from picofx.parallel import ParallelMesh
from picofx.passes import Checkpoint, ContextParallel, Overlap, Pipeline, Precision, Shard, TensorParallel

BATCH = 8  # 4 data-parallel replicas (HSDP) of 2 sequences, each 2 micro-batches under a pipeline
SMALL_BUCKETS = dict(bucket="64KiB", first_bucket="16KiB")  # several buckets on the tiny model


def tiny():
    return zoo.build("llama-tiny", batch=BATCH)


def cell_passes(cell: Cell) -> list:
    """The passes that run `cell`, listed in no particular order (the manager orders them)."""
    f = cell.features
    passes = [name for name in ("fuse", "precision") if name in f and not (name == "precision" and "float8" in f)]
    if "float8" in f:
        passes.append(Precision(float8="tensorwise", float8_layers="all"))
    if "checkpoint" in f:
        passes.append(Checkpoint(budget=0.9))
    if "tensor_parallel" in f:
        passes.append(TensorParallel(sequence_parallel="sequence_parallel" in f, async_overlap="async_tp" in f))
    if "pipeline" in f:
        passes.append(Pipeline(stages=2, microbatches=2))
    if "context_parallel" in f:
        passes.append(ContextParallel(method="ring" if "ring" in f else "allgather"))
    if "shard" in f:  # HSDP too: the mesh's dp_replicate and dp_shard
        stage = next((int(name[-1]) for name in ("shard_stage1", "shard_stage2") if name in f), 3)
        passes.append(Shard(compress=cell.compress, stage=stage))
    if "overlap" in f:
        passes.append(Overlap(compress=cell.compress, **SMALL_BUCKETS))
    return passes


def replica(mesh: ParallelMesh) -> tuple[int, int]:
    """(this rank's data-parallel replica, how many there are): dp_replicate outer, dp_shard inner."""
    shard, rep = mesh.dim("dp_shard"), mesh.dim("dp_replicate")
    return rep.rank * shard.size + shard.rank, rep.size * shard.size


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run_cell(cell: Cell, backend: str) -> dict:
    mesh = ParallelMesh.build(**cell.mesh)
    index, replicas = replica(mesh)
    z = tiny()
    batch = {k: v.chunk(replicas)[index].contiguous() for k, v in z.example_inputs.items()}
    opt = picofx.optimize(z.model, batch, cell_passes(cell), backend=backend, loss_fn=z.loss_fn, mesh=mesh)
    loss = opt.forward_backward(**batch)
    return {"loss": loss.detach().clone(), "replica": index, "replicas": replicas,
            "grads": {n: whole(p.grad) for n, p in opt.named_parameters() if p.grad is not None},
            "ran": [r.name for r in opt.report.records],
            "tokens_per_rank": [r.notes["tokens_per_rank"] for r in opt.report.records
                                if r.name == "context_parallel" and "tokens_per_rank" in r.notes],
            "shard_spans": spans(opt, "shard"), "overlap_spans": spans(opt, "overlap"),
            "local_fraction": local_fraction(opt),
            "float8_linears": sum(r.notes.get("float8_linears", 0) for r in opt.report.records
                                  if r.name == "precision")}


def spans(opt, pass_name: str) -> list[str]:
    """The mesh dimensions a data-parallel pass said its collectives span."""
    return sorted({r.notes["spans"] for r in opt.report.records if r.name == pass_name and "spans" in r.notes})


def local_fraction(opt) -> float:
    """The share of the model's parameter elements this rank holds."""
    held = [(p.to_local() if isinstance(p, DTensor) else p).numel() for p in opt.parameters()]
    return sum(held) / sum(p.numel() for p in opt.parameters())


def run_cells(rank: int, world: int, cells: list, backend: str = "eager", say: bool = False) -> dict:
    """Every cell in turn: its result, or the error it raised (the other ranks raise it too, or time
    out in a collective and say so), with its seconds; `say`: rank 0 prints each as it ends."""
    out = {}
    for cell in cells:
        start = time.perf_counter()
        try:
            out[cell] = run_cell(cell, backend)
        except Exception as e:  # noqa: BLE001  reported per cell; the test fails that cell
            out[cell] = {"error": f"{type(e).__name__}: {e}"}
        out[cell]["seconds"] = time.perf_counter() - start
        if say and rank == 0:
            print(f"cell {cell.describe()}: {out[cell]['seconds']:.1f}s {out[cell].get('error', 'ran')}", flush=True)
    return out


def adamw_and_checkpoint(rank: int, world: int, cells: list, root: str) -> dict:
    """Per cell: three AdamW steps on this rank's replica's batch (the losses), the parameters
    after them, whole, and a DCP checkpoint of the model from every rank, under root/<cell>."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out = {}
    for cell in cells:
        mesh = ParallelMesh.build(**cell.mesh)
        index, replicas = replica(mesh)
        z = tiny()
        batch = {k: v.chunk(replicas)[index].contiguous() for k, v in z.example_inputs.items()}
        opt = picofx.optimize(z.model, batch, cell_passes(cell), backend="eager", loss_fn=z.loss_fn, mesh=mesh)
        optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-3)
        losses = []
        for _ in range(3):
            losses.append(opt.forward_backward(**batch).detach().clone())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        dcp.save(get_model_state_dict(z.model), checkpoint_id=f"{root}/{cell.describe().replace(' + ', '+')}")
        out[cell] = {"losses": losses, "replica": index, "replicas": replicas, "tokens_per_rank": [
                         r.notes["tokens_per_rank"] for r in opt.report.records if "tokens_per_rank" in r.notes],
                     "parameters": {n: whole(p) for n, p in z.model.named_parameters()}}
    return out
