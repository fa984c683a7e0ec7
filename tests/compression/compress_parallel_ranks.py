"""What each of four gloo ranks runs for tests/compression/test_compress_parallel.py: the data-parallel
gradient exchange compressed under tensor parallelism (dp 2 x tp 2) and under a pipeline (dp 2 x
pp 2). Each replica trains its own half of the batch; results go back to the test process."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import picofx
from picofx.models import zoo
from picofx.parallel import ParallelMesh
from picofx.passes import Overlap, Pipeline, TensorParallel

BATCH, SEQ = 4, 16
LOSSLESS = (None, "sparse_rows", "bf16")
LOSSY = ("int8:ef", "topk:0.05", "powersgd:2")
REFUSED = {("tp", "topk:0.05")}  # the composability table refuses top-k beside tensor parallelism


def model():
    return zoo.build("llama-tiny", batch=BATCH, seq=SEQ, seed=0)


def replica_batch(z, replica: int, step: int = 0) -> dict:
    """This replica's half of the step's batch (step 0: the zoo's example batch)."""
    ids = z.example_inputs["input_ids"] if step == 0 else torch.randint(
        0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    labels = z.example_inputs["labels"] if step == 0 else ids.roll(-1, dims=1)
    return {"input_ids": ids.chunk(2)[replica].contiguous(), "labels": labels.chunk(2)[replica].contiguous()}


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def layouts():
    """(name, mesh, passes for a compress kind): the two ways the exchange runs beside model parallelism."""
    # start=0: compressed from the first step, so the steps before the checkpoint are the codec's own
    # (a resumed run would count PowerSGD's int8 start steps again)
    return [("tp", lambda: ParallelMesh.build(dp_replicate=2, tp=2),
             lambda kind: [TensorParallel(), Overlap(compress=kind, start=0)]),
            ("pp", lambda: ParallelMesh.build(pp=2, dp_replicate=2),
             lambda kind: [Pipeline(stages=2, microbatches=2), Overlap(compress=kind, start=0)])]


def step(opt, z, batch: dict) -> tuple[torch.Tensor, dict]:
    z.model.zero_grad(set_to_none=True)
    loss = opt.forward_backward(**batch)
    return loss.detach(), {n: full(p.grad) for n, p in opt.named_parameters() if p.grad is not None}


def compressed_exchanges(rank: int, world: int, directory: str) -> dict:
    """Per layout and kind: the loss and gathered gradients of one step; for the lossy kinds, two more
    steps, the second again after the state was saved by DCP, reset and loaded (a resumed run)."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for name, make_mesh, passes in layouts():
        mesh = make_mesh()
        replica = mesh.dim("dp_replicate").rank
        for kind in LOSSLESS + LOSSY:
            if (name, kind) in REFUSED:
                continue
            z = model()
            first = replica_batch(z, replica)
            opt = picofx.optimize(z.model, first, passes(kind), backend="eager", loss_fn=z.loss_fn, mesh=mesh)
            loss, grads = step(opt, z, first)
            notes = next(r.notes for r in opt.report.records if r.name == "overlap" and r.notes.get("buckets"))
            result = {"replica": replica, "loss": loss, "grads": grads, "notes": notes}
            if kind in LOSSY:
                second, third = replica_batch(z, replica, 1), replica_batch(z, replica, 2)
                step(opt, z, second)
                where = f"{directory}/{name}_{kind.replace(':', '_').replace('+', '_')}"
                dcp.save({"compression": opt.compression}, checkpoint_id=where)
                result["third"] = step(opt, z, third)[1]
                result["keys"] = sorted(opt.compression.state_dict())
                opt.reset_compression()
                dcp.load({"compression": opt.compression}, checkpoint_id=where)
                result["third_resumed"] = step(opt, z, third)[1]
            out[f"{name} {kind}"] = result
    out["pp warmup"] = refused(lambda: warmed_pipeline(mesh, replica))  # mesh: the last layout's, pp
    return out


def warmed_pipeline(mesh, replica: int) -> None:
    z = model()
    batch = replica_batch(z, replica)
    passes = [Pipeline(stages=2, microbatches=2), Overlap(compress="powersgd:2", warmup=1)]
    picofx.optimize(z.model, batch, passes, backend="eager", loss_fn=z.loss_fn, mesh=mesh).forward_backward(**batch)


def refused(run) -> str:
    try:
        run()
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        return str(e)
    return "not refused"
