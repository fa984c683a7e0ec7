"""What each gloo rank runs for tests/passes/test_pipeline_parallel.py: pipelines whose stages are
split over tensor-parallel ranks, with sequence parallelism or with data-parallel replicas. Results
go back to the test process, which compares them with one process."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import picofx
from picofx.models import zoo
from picofx.parallel import ParallelMesh
from picofx.passes import Pipeline, TensorParallel

STEPS = 2  # AdamW steps; the gradients compared are the first step's
LR = 1e-3


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train(opt, batch: dict) -> dict:
    """STEPS AdamW steps of the pipelined model on `batch`: the losses, the first step's gathered
    gradients, the parameters after the last step."""
    optimizer = torch.optim.AdamW(opt.parameters(), lr=LR)
    losses, grads = [], None
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses.append(opt.forward_backward(**batch).detach())
        if grads is None:
            grads = {n: full(p.grad) for n, p in opt.named_parameters()}
        optimizer.step()
    return {"losses": losses, "grads": grads, "parameters": {n: full(p) for n, p in opt.named_parameters()}}


def received_shapes(opt) -> dict:
    """Per stage of this rank, the shapes of the floating-point values it receives from the stage before."""
    shapes = {}
    for module in opt.pipeline.modules:
        placeholders = [n for n in opt.pipeline.graph_of[module.stage.index].graph.nodes if n.op == "placeholder"]
        shapes[module.stage.index] = [list(n.meta["val"].shape) for n in placeholders[len(module.resident):]
                                      if n.meta["val"].is_floating_point()]
    return shapes


def sequence_parallel(rank: int, world: int, directory: str) -> dict:
    """4 ranks as pp 2 x tp 2 with sequence parallelism (async TP's chunks, the default), every rank
    on the whole batch, and a DCP checkpoint of the trained stages; then one step without the chunks,
    and one of a tied embedding and head (without sequence parallelism)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    def pipelined(z, async_overlap: bool):
        return picofx.optimize(z.model, z.example_inputs, [
            Pipeline(stages=2, microbatches=2), TensorParallel(sequence_parallel=True, async_overlap=async_overlap)],
            backend="eager", loss_fn=z.loss_fn, mesh=mesh)

    mesh = ParallelMesh.build(pp=2, tp=2)
    z = zoo.build("llama-tiny", batch=4, seq=16)
    opt = pipelined(z, async_overlap=True)
    out = train(opt, dict(z.example_inputs))
    out["received"] = received_shapes(opt)
    dcp.save(opt.state_dict(), checkpoint_id=directory)
    dist.barrier()
    z = zoo.build("llama-tiny", batch=4, seq=16)
    opt = pipelined(z, async_overlap=False)
    loss = opt.forward_backward(**dict(z.example_inputs))
    out["unchunked"] = {"loss": loss.detach(), "grads": {n: full(p.grad) for n, p in opt.named_parameters()}}
    out["tied"] = tied_step(mesh)
    return out


def tied_step(mesh) -> dict:
    """One step of HF Llama with its embedding tied to its head over pp 2 x tp 2: the two stages'
    vocabulary-split pieces of the one parameter summed after the schedule."""
    from picofx.models import real_models

    z = real_models.hf_model("llama", tie_word_embeddings=True)
    opt = picofx.optimize(z.model, z.example_inputs, [Pipeline(stages=2, microbatches=2), TensorParallel()],
                          backend="eager", loss_fn=z.loss_fn, mesh=mesh)
    loss = opt.forward_backward(**dict(z.example_inputs))
    return {"loss": loss.detach(), "grads": {n: full(p.grad) for n, p in opt.named_parameters()}}


def replicated(rank: int, world: int, overlap: bool) -> dict:
    """8 ranks as pp 2 x dp_replicate 2 x tp 2: each replica its half of the batch."""
    mesh = ParallelMesh.build(pp=2, dp_replicate=2, tp=2)
    z = zoo.build("llama-tiny", batch=8, seq=16)
    half = {k: v.chunk(2)[mesh.dim("dp_replicate").rank].contiguous() for k, v in dict(z.example_inputs).items()}
    passes = [Pipeline(stages=2, microbatches=2), TensorParallel(), *(["overlap"] if overlap else [])]
    opt = picofx.optimize(z.model, half, passes, backend="eager", loss_fn=z.loss_fn, mesh=mesh)
    return train(opt, half)
