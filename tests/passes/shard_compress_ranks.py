"""What each rank runs in tests/passes/test_shard_compress.py (spawned: module-level functions).

Each kind of `Shard(compress=...)` on the tiny LLaMA: gathered gradients of a step, the backward's
notes; for int8:ef two more steps, the state's DCP round trip and AdamW steps; top-k and
PowerSGD next to Overlap with the same compressor; each rank's own eager gradients for the
int8 block bound."""
from __future__ import annotations

import copy

import torch

import picofx
from picofx.models import zoo
from picofx.passes import Overlap, Shard

from compress_ranks import walks, warmup_run
from overlap_ranks import clear, grads, shard
from shard_ranks import gathered_grads

KINDS = (None, "sparse_rows", "bf16", "int8:ef")


def backward_notes(opt, name: str) -> dict:
    return next(r.notes for r in opt.report.records if r.name == name and r.graph_role == "backward"
                and r.stage.value == "partitioned")


def local_grads(model, batch: dict, loss_fn) -> dict:
    """This rank's own gradients of its batch, eager (before any exchange)."""
    model = copy.deepcopy(model)
    loss_fn(model(batch["input_ids"]), batch["labels"]).backward()
    return grads(model)


def step(opt, model, batch: dict) -> dict:
    clear(model)
    opt.forward_backward(**batch)
    return gathered_grads(model)


def shard_compress_checks(rank: int, world: int, batch: int, checkpoint_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp

    out = {}
    for kind in KINDS:
        z = zoo.build("llama-tiny", batch=batch)
        first = shard(z.example_inputs, rank, world)
        if kind is None:
            out["local"] = local_grads(z.model, first, z.loss_fn)
        opt = picofx.optimize(z.model, first, [Shard(compress=kind)], backend="eager", loss_fn=z.loss_fn)
        result = out[str(kind)] = {"first": step(opt, z.model, first), "notes": backward_notes(opt, "shard")}
        if kind not in (None, "int8:ef"):
            continue
        second = shard(walks(256, batch, 32, seed=7), rank, world)
        result["second"] = step(opt, z.model, second)
        if kind is None:
            continue
        state = opt.compression
        result["state"] = {k: v.clone() for k, v in state.tensors.items()}
        dcp.save({"compression": state}, checkpoint_id=checkpoint_dir)
        opt.reset_compression()
        result["reset_state"] = {k: v.clone() for k, v in state.tensors.items()}
        dcp.load({"compression": state}, checkpoint_id=checkpoint_dir)
        result["loaded_state"] = {k: v.clone() for k, v in state.tensors.items()}
        opt.reset_compression()
        result["second_after_reset"] = step(opt, z.model, second)
        result["losses"] = adamw_losses(opt, z.model, first)
    out["tied"] = tied_notes(rank, world, batch)
    out["warmup"] = warmup_steps(rank, world, batch)
    out["codecs"] = {kind: next_to_overlap(rank, world, batch, kind, bucket)
                     for kind, bucket in (("topk:0.01", 0), ("powersgd:4", "auto"))}
    return out


def adamw_losses(opt, model, batch: dict, steps: int = 4) -> list[float]:
    optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(opt.forward_backward(**batch).item())
        optimizer.step()
    return losses


def warmup_steps(rank: int, world: int, batch: int) -> dict:
    """topk:0.01 with warmup=1: the first step reduce-scattered uncompressed, then compressed;
    after reset_compression the warm-up runs again."""
    z = zoo.build("llama-tiny", batch=batch)
    first = shard(z.example_inputs, rank, world)
    second = shard(walks(256, batch, 32, seed=7), rank, world)
    opt = picofx.optimize(z.model, first, [Shard(compress="topk:0.01", warmup=1)], backend="eager", loss_fn=z.loss_fn)
    out = warmup_run(opt, lambda data: step(opt, z.model, data), first, second)
    out["compressors"] = {key[2]: {b["compressor"] for r in built.report.records if r.name == "shard"
                                   for b in r.notes.get("compression", [])} for key, built in opt._steps.items()}
    return out


def tied_notes(rank: int, world: int, batch: int) -> dict:
    from picofx.models.llama_configs import LlamaVariant, build

    z = build(LlamaVariant(tied=True), batch=batch)
    example = shard(z.example_inputs, rank, world)
    opt = picofx.optimize(z.model, example, [Shard(compress="sparse_rows")], backend="eager", loss_fn=z.loss_fn)
    opt.forward_backward(**example)
    return backward_notes(opt, "shard")


def next_to_overlap(rank: int, world: int, batch: int, kind: str, bucket) -> dict:
    """Shard and Overlap with `kind` on the same step (Overlap without its int8 start, as Shard runs); top-k
    one parameter per bucket in both."""
    out = {}
    overlap = Overlap(compress=kind, start=0, **({"bucket": 1, "first_bucket": 1} if bucket == 0 else {}))
    for name, p in (("shard", Shard(compress=kind, bucket=bucket)), ("overlap", overlap)):
        z = zoo.build("llama-tiny", batch=batch)
        example = shard(z.example_inputs, rank, world)
        opt = picofx.optimize(z.model, example, [p], backend="eager", loss_fn=z.loss_fn)
        out[name] = {"grads": step(opt, z.model, example), "notes": backward_notes(opt, name),
                     "state": sorted(k for k in opt.compression.tensors if k.startswith(("residual", "powersgd")))}
    return out


def training_losses(rank: int, world: int, batch: int, kinds: tuple, steps: int, lr: float) -> dict:
    """AdamW over the shards on fresh token walks every step, per kind (or (kind, its warmup)):
    each step's loss averaged over the ranks."""
    import torch.distributed as dist

    out = {}
    for entry in kinds:
        kind, warmup = entry if isinstance(entry, tuple) else (entry, 0)
        z = zoo.build("llama-tiny", batch=batch)
        opt = picofx.optimize(z.model, shard(z.example_inputs, rank, world), [Shard(compress=kind, warmup=warmup)],
                              backend="eager", loss_fn=z.loss_fn)
        optimizer = torch.optim.AdamW(opt.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = opt.forward_backward(**shard(walks(256, batch, 32, seed=1000 + step), rank, world))
            optimizer.step()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        out[str(entry)] = losses
    return out


def inductor_grads(rank: int, world: int, batch: int, kinds: tuple, backend: str) -> dict:
    """Per kind, Shard(compress=kind) compiled by `backend`: two steps' gathered gradients and the
    compressor state the compiled code left (Inductor writes the state buffers in place)."""
    out = {}
    for kind in kinds:
        z = zoo.build("llama-tiny", batch=batch)
        data = shard(z.example_inputs, rank, world)
        opt = picofx.optimize(z.model, data, [Shard(compress=kind)], backend=backend, loss_fn=z.loss_fn)
        first = step(opt, z.model, data)
        second = step(opt, z.model, shard(walks(256, batch, 32, seed=7), rank, world))
        state = {k: v.clone() for k, v in opt.compression.tensors.items()} if opt.compression is not None else {}
        out[kind] = {"first": first, "second": second, "state": state}
    return out
