"""What each rank runs in tests/passes/test_shard_stages.py (spawned: importable functions).

A step is 4 micro-batches: 4 calls of the optimized model, the first 3 under no_sync, each loss
divided by 4; or, under a pipeline, one forward_backward of 4 micro-batches. Each scenario returns
plain tensors (gradients and parameters gathered whole) and the collectives each step issued."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import picofx
from picofx.models import zoo
from picofx.parallel import ParallelMesh
from picofx.passes import Pipeline, Shard, TensorParallel

BATCH, SEQ, MICRO = 16, 16, 4  # 4 micro-batches on each of 4 dp_shard ranks


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def batch_of(step: int, index: int, replicas: int) -> dict:
    """This replica's rows of step `step`'s batch (the full batch rolled by the step)."""
    z = zoo.build("llama-tiny", batch=BATCH, seq=SEQ)
    return {k: v.roll(step, dims=-1).chunk(replicas)[index].contiguous() for k, v in z.example_inputs.items()}


@contextlib.contextmanager
def counted(calls: list):
    """Count the gathers and reduce-scatters issued (kind, elements sent) while inside."""
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def counting(name):
        def call(out, inp, *args, **kwargs):
            calls.append((name, inp.numel()))
            return originals[name](out, inp, *args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def traced(events: list):
    """Record each reduce-scatter's issue and its wait, ("issue" | "wait", its number), in order."""
    original = dist.reduce_scatter_single

    class Waited:
        def __init__(self, work, number):
            self.work, self.number = work, number

        def wait(self, *args, **kwargs):
            events.append(("wait", self.number))
            return self.work.wait(*args, **kwargs)

    def call(*args, **kwargs):
        number = sum(kind == "issue" for kind, _ in events)
        events.append(("issue", number))
        work = original(*args, **kwargs)
        return Waited(work, number) if work is not None else None

    dist.reduce_scatter_single = call
    try:
        yield
    finally:
        dist.reduce_scatter_single = original


def train(opt, model, steps: int, index: int, replicas: int, pipelined: bool, discarded: bool = False,
          trace: bool = False) -> dict:
    """`steps` AdamW steps (gradient norm clipped to 1), each of MICRO micro-batches: accumulated
    under no_sync in even steps, by set_requires_gradient_sync (FSDP2's spelling) in odd ones.
    `discarded`: each step first accumulates a micro-batch of other tokens unsynced, then zeroes
    the gradients (`optimizer.zero_grad()`, set_to_none in even steps, in place in odd ones), as a
    loop that skips a step does: none of it may reach the step's gradients. `trace`: record each step's
    reduce-scatters issued and waited (`traced`) among ("forward" | "returned", micro-batch)."""
    optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-3)
    out = {"losses": [], "grads": [], "collectives": [], "norms": [], "events": []}
    for step in range(steps):
        batch, calls, events = batch_of(step, index, replicas), [], []
        log = events.append if trace else (lambda event: None)
        with counted(calls), traced(events) if trace else contextlib.nullcontext():
            if discarded:
                other = batch_of(step + 5, index, replicas)
                with opt.no_sync():
                    micro_loss(opt, other, tuple(v.chunk(MICRO)[0] for v in other.values()))
                optimizer.zero_grad(set_to_none=step % 2 == 0)
            if pipelined:
                loss = opt.forward_backward(**batch)
            else:
                loss = 0.0
                for i, micro in enumerate(zip(*(v.chunk(MICRO) for v in batch.values()))):
                    last = i == MICRO - 1
                    log(("forward", i))
                    if step % 2:
                        opt.set_requires_gradient_sync(last)
                        loss += micro_loss(opt, batch, micro)
                    else:
                        with contextlib.nullcontext() if last else opt.no_sync():
                            loss += micro_loss(opt, batch, micro)
                    log(("returned", i))
        out["collectives"].append(calls)
        out["events"].append(events)
        out["losses"].append(torch.as_tensor(loss).detach().clone())
        out["grads"].append({n: whole(p.grad) for n, p in opt.named_parameters() if p.grad is not None})
        out["norms"].append(whole(torch.nn.utils.clip_grad_norm_(opt.parameters(), max_norm=1.0)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out["params"] = {n: whole(p) for n, p in opt.named_parameters()}
    out["state"] = sorted({str(v.placements) for s in optimizer.state.values() for v in s.values()
                           if isinstance(v, DTensor)})
    out["shapes"] = {n: tuple(p.shape) for n, p in opt.named_parameters()}
    out["local_elements"] = sum(p.to_local().numel() for p in opt.parameters())
    return out


def micro_loss(opt, batch: dict, micro: tuple) -> torch.Tensor:
    out = opt(**dict(zip(batch, (m.contiguous() for m in micro))))
    loss = (out if isinstance(out, torch.Tensor) else out.loss) / MICRO
    loss.backward()
    return loss.detach()


def unsynced_step(opt, index: int, replicas: int) -> dict:
    """Step 0's micro-batches, every backward under no_sync, then an optimizer step (SGD at lr 0: the
    parameters keep their values): the reduce-scatters issued and waited before and after the step,
    and the gradients the step read."""
    events, before = [], []
    with traced(events):
        batch = batch_of(0, index, replicas)
        with opt.no_sync():
            for micro in zip(*(v.chunk(MICRO) for v in batch.values())):
                micro_loss(opt, batch, micro)
        before = list(events)
        optimizer = torch.optim.SGD(opt.parameters(), lr=0.0)
        optimizer.step()
    out = {"before_step": before, "after_step": events[len(before):],
           "grads": {n: whole(p.grad) for n, p in opt.named_parameters() if p.grad is not None}}
    optimizer.zero_grad(set_to_none=True)
    return out


def run_stage(rank: int, world: int, stage: int, pp: int, checkpoint: str | None = None, tp: int = 1,
              sequence_parallel: bool = False, discarded: bool = False, replicas: int = 1, trace: bool = False,
              unsynced: bool = False):
    """`replicas`: HSDP's dp_replicate (the sharded groups, each a replica of the shards); `unsynced`:
    an unsynced step (`unsynced_step`) before the two steps."""
    mesh = ParallelMesh.build(pp=pp, dp_replicate=replicas, dp_shard=world // (pp * tp * replicas), tp=tp)
    dp, rep = mesh.dim("dp_shard"), mesh.dim("dp_replicate")
    index, count = rep.rank * dp.size + dp.rank, rep.size * dp.size  # this rank's data-parallel replica
    z = zoo.build("llama-tiny", batch=BATCH, seq=SEQ)
    passes = [Shard(stage=stage)] + ([Pipeline(stages=pp, microbatches=MICRO)] if pp > 1 else [])
    passes += [TensorParallel(sequence_parallel=sequence_parallel)] if tp > 1 else []
    example = batch_of(0, index, count)
    if pp == 1:
        example = {k: v.chunk(MICRO)[0].contiguous() for k, v in example.items()}
    opt = picofx.optimize(z.model, example, passes, backend="eager", loss_fn=z.loss_fn, mesh=mesh)
    first = unsynced_step(opt, index, count) if unsynced else None
    out = train(opt, z.model, 2, index, count, pp > 1, discarded, trace)
    out["unsynced"] = first
    out["replica"] = index
    out["notes"] = [r.notes for r in opt.report.records if r.name == "shard" and r.changed]
    if checkpoint is not None:
        out["restored"] = dcp_round_trip(opt, checkpoint)
    return out


def dcp_round_trip(opt, root: str) -> bool:
    """Save the model with DCP, scramble the parameters, load them back: equal to what was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    saved = {n: whole(p) for n, p in opt.named_parameters()}
    dcp.save(get_model_state_dict(opt), checkpoint_id=f"{root}/stage")
    with torch.no_grad():
        for p in opt.parameters():
            p.zero_()
    state = get_model_state_dict(opt)
    dcp.load(state, checkpoint_id=f"{root}/stage")
    set_model_state_dict(opt, state)
    return all(torch.equal(whole(p), saved[n]) for n, p in opt.named_parameters())


def stage1_accumulation(rank, world, checkpoint):
    return run_stage(rank, world, 1, pp=1, checkpoint=checkpoint, discarded=True)


def stage2_in_flight(rank, world):
    """Stage 2's accumulation with a discarded micro-batch each step, its reduce-scatters traced."""
    return run_stage(rank, world, 2, pp=1, discarded=True, trace=True, unsynced=True)


def stage2_accumulation(rank, world):
    return run_stage(rank, world, 2, pp=1)


def stage1_pipeline(rank, world):
    return run_stage(rank, world, 1, pp=2)


def stage2_pipeline(rank, world):
    return run_stage(rank, world, 2, pp=2)


def stage1_tensor_parallel(rank, world, checkpoint):
    return run_stage(rank, world, 1, pp=1, checkpoint=checkpoint, tp=2, discarded=True)


def stage2_sequence_parallel(rank, world, checkpoint):
    return run_stage(rank, world, 2, pp=1, checkpoint=checkpoint, tp=2, sequence_parallel=True)


def stage1_hsdp(rank, world):
    return run_stage(rank, world, 1, pp=1, replicas=2, discarded=True)


def stage2_hsdp(rank, world):
    return run_stage(rank, world, 2, pp=1, replicas=2)


def stage1_tensor_parallel_pipeline(rank, world):
    return run_stage(rank, world, 1, pp=2, tp=2)


def stage2_sequence_parallel_pipeline(rank, world):
    return run_stage(rank, world, 2, pp=2, tp=2, sequence_parallel=True)
