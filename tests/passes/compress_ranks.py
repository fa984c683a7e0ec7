"""What each rank runs in the gradient-compression tests (spawned: module-level functions).

Each returns plain tensors and facts; tests/passes/test_compress.py compares them across ranks
and with the uncompressed run."""
from __future__ import annotations

import torch

import picofx
from picofx.models import zoo
from picofx.passes import Overlap

from overlap_ranks import clear, grads, shard

SMALL_BUCKETS = dict(bucket="64KiB", first_bucket="16KiB")  # several buckets on the tiny model
KINDS = (None, "sparse_rows", "sparse_rows+int8", "int8:ef", "topk:0.01", "powersgd:4")


def walks(vocab: int, batch: int, seq: int, seed: int) -> dict:
    """Random token walks: each row starts anywhere and moves one token up or down (mod vocab)
    at random, so the best a model can do is a loss of ln 2 (it cannot know the next coin)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    moves = torch.randint(0, 2, (batch, seq), generator=g) * 2 - 1
    ids = (start + torch.cat([torch.zeros(batch, 1, dtype=torch.long), moves.cumsum(1)], 1)) % vocab
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def optimized(kind, rank: int, world: int, batch: int, backend: str = "eager", start: int = 0, **overlap):
    """The tiny reference LLaMA with Overlap(compress=kind); by default without the lossy codecs'
    int8 start (start=0), so the checks see the compressor itself from the first step."""
    z = zoo.build("llama-tiny", batch=batch)
    example = shard(z.example_inputs, rank, world)
    opt = picofx.optimize(z.model, example, [Overlap(compress=kind, start=start, **{**SMALL_BUCKETS, **overlap})],
                          backend=backend, loss_fn=z.loss_fn)
    return z, opt


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def state_of(opt) -> dict:
    return {k: v.clone() for k, v in opt.compression.tensors.items()} if opt.compression is not None else {}


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
    out["warmup"] = warmup_steps(rank, world, batch)
    out["start"] = start_steps(rank, world, batch)
    out["errors"] = compression_errors(rank, world, batch)
    return out


def compression_errors(rank: int, world: int, batch: int) -> dict:
    """Per kind, after one step: the report's relative_error per bucket, and the same figure from
    this rank's own gradients (the model run eagerly, unsynced) and the residuals the step left:
    ||residual|| / ||gradient|| over the bucket's parameters (error feedback starts from zero)."""
    from picofx.parallel.layouts import recorded

    out = {}
    for kind in ("bf16", "sparse_rows+int8", "int8:ef", "topk:0.01", "powersgd:4"):
        z, opt = optimized(kind, rank, world, batch)
        data = shard(z.example_inputs, rank, world)
        step_grads(opt, z.model, data)
        record = next(r for r in opt.report.records if r.name == "overlap" and r.notes.get("buckets"))
        clear(z.model)
        z.loss_fn(z.model(data["input_ids"]), data["labels"]).backward()
        own = grads(z.model)
        members: dict[int, list[str]] = {}
        for entry in recorded(opt.graphs["backward"]).buckets.entries:
            members.setdefault(entry.bucket, []).append(entry.name)
        state = opt.compression.tensors if opt.compression is not None else {}
        expected = {}
        for k, names in members.items():
            residuals = [state[f"residual/{n}"] for n in names if f"residual/{n}" in state]
            if residuals:
                left = torch.cat([r.reshape(-1) for r in residuals]).norm()
                expected[k] = (left / torch.cat([own[n].reshape(-1) for n in names]).norm()).item()
        out[kind] = {"reported": {b["bucket"]: b.get("relative_error") for b in record.notes["compression"]},
                     "compressor": {b["bucket"]: b["compressor"] for b in record.notes["compression"]},
                     "expected": expected}
    return out


def warmup_steps(rank: int, world: int, batch: int) -> dict:
    """powersgd:4 with warmup=1: the first step all-reduced whole, then compressed; after
    reset_compression the warm-up runs again."""
    z, opt = optimized("powersgd:4", rank, world, batch, warmup=1)
    first = shard(z.example_inputs, rank, world)
    second = shard(walks(256, batch, 32, seed=7), rank, world)
    return warmup_run(opt, lambda data: step_grads(opt, z.model, data), first, second)


def start_steps(rank: int, world: int, batch: int) -> dict:
    """powersgd:4 with its int8 start (Overlap's default start): three steps' gradients, the state
    after each of the first two, the notes, and int8's own first step for comparison."""
    from picofx.compression import START_STEPS

    z, opt = optimized("powersgd:4", rank, world, batch, start=START_STEPS)
    batches = [shard(z.example_inputs, rank, world)]
    batches += [shard(walks(256, batch, 32, seed=s), rank, world) for s in (7, 8)]
    out = {"steps": [], "states": []}
    for data in batches:
        out["steps"].append(step_grads(opt, z.model, data))
        out["states"].append(state_of(opt))
    out["first_q"] = {f"powersgd4/{name}": q.clone() for (_, name), q in opt.compression.powersgd.first.items()}
    out["notes"] = [r.notes for r in opt.report.records if r.name == "overlap" and r.notes.get("buckets")]
    out["variants"] = sorted(key[2] for key in opt._steps)
    z8, int8 = optimized("int8", rank, world, batch)
    out["int8_first"] = step_grads(int8, z8.model, batches[0])
    return out


def warmup_run(opt, run_step, first: dict, second: dict) -> dict:
    """A warmup=1 run's gradients (`run_step(batch)`) of two steps, its residuals after the first,
    the second step again after reset_compression, and the step variants it compiled."""
    out = {"first": run_step(first)}
    out["residual_after_first"] = {k: v.clone() for k, v in opt.compression.tensors.items() if k.startswith("residual")}
    out["second"] = run_step(second)
    opt.reset_compression()
    out["second_after_reset"] = run_step(second)
    out["variants"] = sorted(key[2] for key in opt._steps)
    return out


def tied_embedding(rank: int, world: int, batch: int) -> dict:
    """sparse_rows on a model whose head shares the embedding: the gradient is dense, so it stays dense."""
    from picofx.models.llama_configs import LlamaVariant, build

    out = {}
    for kind in (None, "sparse_rows"):
        z = build(LlamaVariant(tied=True), batch=batch)
        example = shard(z.example_inputs, rank, world)
        opt = picofx.optimize(z.model, example, [Overlap(compress=kind, **SMALL_BUCKETS)], backend="eager",
                              loss_fn=z.loss_fn)
        record = next(r for r in opt.report.records if r.name == "overlap" and r.notes.get("buckets"))
        out[str(kind)] = {"grads": step_grads(opt, z.model, example), "notes": record.notes}
    return out


def training_losses(rank: int, world: int, batch: int, kinds: tuple, steps: int, lr: float, warmup: int = 0) -> dict:
    """AdamW on fresh token walks every step, per kind (or (kind, its own warmup)): each step's loss
    averaged over the ranks, and the step variants compiled (Overlap's warmup adds one)."""
    import torch.distributed as dist

    out = {}
    from picofx.compression import START_STEPS

    for entry in kinds:  # a kind alone starts as Overlap does by default (a lossy one with int8 steps)
        kind, steps_whole = entry if isinstance(entry, tuple) else (entry, warmup)
        z, opt = optimized(kind, rank, world, batch, warmup=steps_whole, start=START_STEPS)
        optimizer = torch.optim.AdamW(z.model.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            data = shard(walks(256, batch, 32, seed=1000 + step), rank, world)
            optimizer.zero_grad(set_to_none=True)
            loss = opt.forward_backward(**data)
            optimizer.step()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        out[str(entry if isinstance(entry, tuple) else kind)] = {"losses": losses, "variants": sorted(key[2] for key in opt._steps),
                          "params": {n: p.detach().clone() for n, p in z.model.named_parameters()}}
    return out


def inductor_checks(rank: int, world: int, batch: int, kinds: tuple, backend: str = "inductor") -> dict:
    """Each kind compiled by `backend`: two steps' gradients, the generated code (Inductor), the
    compressor state and the second step's relative errors the compiled code left."""
    from torch._inductor.utils import run_and_get_code

    out = {}
    for kind in kinds:
        z = zoo.build("llama-tiny", batch=batch)
        example = shard(z.example_inputs, rank, world)
        build = lambda: picofx.optimize(z.model, example, [Overlap(compress=kind, start=0, **SMALL_BUCKETS)],  # noqa: E731
                                        backend=backend, loss_fn=z.loss_fn)
        opt, code = run_and_get_code(build) if backend == "inductor" else (build(), [])
        second = shard(walks(256, batch, 32, seed=7), rank, world)
        record = next(r for r in opt.report.records if r.name == "overlap" and r.notes.get("buckets"))
        out[str(kind)] = {"first": step_grads(opt, z.model, example), "second": step_grads(opt, z.model, second),
                          "code": code, "notes": record.notes, "state": state_of(opt),
                          "errors": opt.compression.errors() if opt.compression is not None else {}}
    return out


def ddp_powersgd_losses(rank: int, world: int, batch: int, steps: int, lr: float, rank_r: int = 4,
                        start: int = 2, seed: int = 0) -> dict:
    """torch's DDP with its powerSGD_hook on the same walks, for comparison (eager, no picofx)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    z = zoo.build("llama-tiny", batch=batch)
    model = DDP(z.model)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                              start_powerSGD_iter=start, random_seed=seed)
    model.register_comm_hook(state, psgd.powerSGD_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        data = shard(walks(256, batch, 32, seed=1000 + step), rank, world)
        optimizer.zero_grad(set_to_none=True)
        loss = z.loss_fn(model(data["input_ids"]), data["labels"])
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return {"losses": losses}
