"""What each rank runs in the gradient-compression tests (spawned: module-level functions).

Each returns plain tensors and facts; tests/passes/test_compress.py compares them across ranks
and with the uncompressed run."""
from __future__ import annotations

import torch

import picofx
from picofx.examples import zoo
from picofx.passes import Overlap

from overlap_ranks import clear, grads, shard

SMALL_BUCKETS = dict(bucket="64KiB", first_bucket="16KiB")  # several buckets on the tiny model
KINDS = (None, "sparse_rows", "sparse_rows+int8", "int8:ef", "topk:0.01", "powersgd:4")


def walks(vocab: int, batch: int, seq: int, seed: int) -> dict:
    """Token walks: each row starts anywhere and steps by 1, 2 or 3 (mod vocab), so the next
    token follows from the last two: a model learns it, unlike uniform noise."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    step = torch.randint(1, 4, (batch, 1), generator=g)
    ids = (start + step * torch.arange(seq + 1)) % vocab
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def optimized(kind, rank: int, world: int, batch: int, backend: str = "eager", **overlap):
    z = zoo.build("llama-tiny", batch=batch)
    example = shard(z.example_inputs, rank, world)
    opt = picofx.optimize(z.model, example, [Overlap(compress=kind, **{**SMALL_BUCKETS, **overlap})],
                          backend=backend, loss_fn=z.loss_fn)
    return z, opt


def step_grads(opt, model, batch: dict) -> dict:
    clear(model)
    opt.forward_backward(**batch)
    return grads(model)


def compressor_checks(rank: int, world: int, batch: int, checkpoint_dir: str) -> dict:
    """Per kind: the gradients of two steps; then, reset, the second step again (error feedback
    and Q start afresh); the report's notes; a DCP round trip of the compressor state."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for kind in KINDS:
        z, opt = optimized(kind, rank, world, batch)
        first = shard(z.example_inputs, rank, world)
        second = shard(walks(256, batch, 32, seed=7), rank, world)
        record = next(r for r in opt.report.records if r.name == "overlap" and r.notes.get("buckets"))
        result = {"first": step_grads(opt, z.model, first), "second": step_grads(opt, z.model, second),
                  "notes": record.notes}
        state = opt.compression
        result["state"] = {k: v.clone() for k, v in state.tensors.items()} if state is not None else {}
        if state is not None:
            dcp.save({"compression": state}, checkpoint_id=f"{checkpoint_dir}/{kind.replace(':', '_')}")
            opt.reset_compression()
            result["reset_state"] = {k: v.clone() for k, v in state.tensors.items()}
            dcp.load({"compression": state}, checkpoint_id=f"{checkpoint_dir}/{kind.replace(':', '_')}")
            result["loaded_state"] = {k: v.clone() for k, v in state.tensors.items()}
            opt.reset_compression()
        result["second_after_reset"] = step_grads(opt, z.model, second)
        out[str(kind)] = result
    out["tied"] = tied_embedding(rank, world, batch)
    return out


def tied_embedding(rank: int, world: int, batch: int) -> dict:
    """sparse_rows on a model whose head shares the embedding: the gradient is dense, so it stays dense."""
    from picofx.examples.llama_configs import LlamaVariant, build

    out = {}
    for kind in (None, "sparse_rows"):
        z = build(LlamaVariant(tied=True), batch=batch)
        example = shard(z.example_inputs, rank, world)
        opt = picofx.optimize(z.model, example, [Overlap(compress=kind, **SMALL_BUCKETS)], backend="eager",
                              loss_fn=z.loss_fn)
        record = next(r for r in opt.report.records if r.name == "overlap" and r.notes.get("buckets"))
        out[str(kind)] = {"grads": step_grads(opt, z.model, example), "notes": record.notes}
    return out


def training_losses(rank: int, world: int, batch: int, kinds: tuple, steps: int, lr: float) -> dict:
    """AdamW on fresh token walks every step, per kind: each step's loss averaged over the ranks."""
    import torch.distributed as dist

    out = {}
    for kind in kinds:
        z, opt = optimized(kind, rank, world, batch)
        optimizer = torch.optim.AdamW(z.model.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            data = shard(walks(256, batch, 32, seed=1000 + step), rank, world)
            optimizer.zero_grad(set_to_none=True)
            loss = opt.forward_backward(**data)
            optimizer.step()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        out[str(kind)] = {"losses": losses,
                          "params": {n: p.detach().clone() for n, p in z.model.named_parameters()}}
    return out


def inductor_checks(rank: int, world: int, batch: int, kinds: tuple, backend: str = "inductor") -> dict:
    """Each kind compiled by `backend`: two steps' gradients and the generated code (Inductor)."""
    from torch._inductor.utils import run_and_get_code

    out = {}
    for kind in kinds:
        z = zoo.build("llama-tiny", batch=batch)
        example = shard(z.example_inputs, rank, world)
        build = lambda: picofx.optimize(z.model, example, [Overlap(compress=kind, **SMALL_BUCKETS)],  # noqa: E731
                                        backend=backend, loss_fn=z.loss_fn)
        opt, code = run_and_get_code(build) if backend == "inductor" else (build(), [])
        second = shard(walks(256, batch, 32, seed=7), rank, world)
        out[str(kind)] = {"first": step_grads(opt, z.model, example), "second": step_grads(opt, z.model, second),
                          "code": code}
    return out
