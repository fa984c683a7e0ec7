"""What each rank runs in the overlap tests (spawned: these functions must be importable).

Each returns plain tensors and facts; the test process compares them with single-process
references, so a wrong rank shows up as a failed assert_close with names."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import picofx
from picofx.cost.device import calibrate_link
from picofx.models import zoo
from picofx.passes import Checkpoint, Overlap
from picofx.testing import op_counts

SMALL_BUCKETS = dict(bucket="64KiB", first_bucket="16KiB")  # several buckets on the tiny models
COLLECTIVES = ("_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default")


def shard(batch: dict, rank: int, world: int) -> dict:
    return {k: v.chunk(world)[rank].contiguous() for k, v in batch.items()}


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def clear(model) -> None:
    for p in model.parameters():
        p.grad = None


def later_batch(batch: dict, shift: int) -> dict:
    return {k: v.roll(shift, dims=-1).contiguous() for k, v in batch.items()}


def backward_order(gm) -> list[str]:
    """Per call_function node of the backward graph: 'all_reduce', 'wait', or 'compute'
    (a node that is neither a collective nor reads one's result)."""
    comm = set()
    kinds = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        if target == COLLECTIVES[0]:
            kinds.append("all_reduce")
        elif target == COLLECTIVES[1]:
            kinds.append("wait")
        elif any(a in comm for a in node.all_input_nodes):
            kinds.append("after_wait")
        else:
            kinds.append("compute")
        if target in COLLECTIVES or any(a in comm for a in node.all_input_nodes):
            comm.add(node)
    return kinds


def reference_llama_checks(rank: int, world: int, batch: int) -> dict:
    """Overlap on the reference LLaMA (eager): one step, no_sync accumulation, replicas after
    AdamW steps, bf16 compression beside DDP's bf16 hook, the graph's order, state_dict keys."""
    z = zoo.build("llama-tiny", batch=batch)
    model = z.model
    keys_before = list(model.state_dict())
    opt = picofx.optimize(model, shard(z.example_inputs, rank, world), ["fuse", Overlap(**SMALL_BUCKETS)],
                          backend="eager", loss_fn=z.loss_fn)
    out = {"order": backward_order(opt.graphs["backward"]), "ops": op_counts(opt.graphs["backward"]),
           "notes": opt.report.records[-1].notes if opt.report.records else {}}
    first, second = z.example_inputs, later_batch(z.example_inputs, 3)
    out["loss"] = opt.forward_backward(**shard(first, rank, world))
    out["grads"] = grads(model)

    clear(model)  # DDP's no_sync: accumulate locally, then one synced backward all-reduces the sum
    with opt.no_sync():
        opt.forward_backward(**shard(first, rank, world))
    out["local_grads"] = grads(model)
    opt.forward_backward(**shard(second, rank, world))
    out["accumulated"] = grads(model)
    opt.forward_backward(**shard(second, rank, world))  # synced again: no leftover from the accumulation
    out["after_accumulation"] = {n: g - out["accumulated"][n] for n, g in grads(model).items()}

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        clear(model)
        opt.forward_backward(**shard(later_batch(first, step + 5), rank, world))
        optimizer.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["state_dict_keys"] = (keys_before, list(opt.state_dict()))
    out.update(bf16_against_ddp(rank, world, batch))
    return out


def bf16_against_ddp(rank: int, world: int, batch: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    z = zoo.build("llama-tiny", batch=batch, seed=1)
    ddp_model = copy.deepcopy(z.model)
    local = shard(z.example_inputs, rank, world)
    opt = picofx.optimize(z.model, local, [Overlap(compress="bf16", **SMALL_BUCKETS)], backend="eager",
                          loss_fn=z.loss_fn)
    opt.forward_backward(**local)
    ddp = DDP(ddp_model)
    # register_comm_hook refuses the bf16 hook without NCCL; gloo all-reduces bf16 on the CPU, so
    # register it on the reducer as register_comm_hook does after that check.
    dist._register_comm_hook(ddp.reducer, None, bf16_compress_hook)
    z.loss_fn(ddp(local["input_ids"]), local["labels"]).backward()
    return {"bf16_grads": grads(z.model), "ddp_bf16_grads": grads(ddp_model),
            "bf16_casts": sum(n for k, n in op_counts(opt.graphs["backward"]).items() if "convert_element_type" in k)}


def hf_llama_checks(rank: int, world: int, batch: int) -> dict:
    """Overlap on Hugging Face Llama with fuse, after recapture on a new sequence length; the
    gloo link as calibrate measures it."""
    z = zoo.build("hf-llama-tiny", batch=batch)
    opt = picofx.optimize(z.model, shard(z.example_inputs, rank, world), ["fuse", Overlap(**SMALL_BUCKETS)],
                          backend="eager")
    out = {"loss": opt.forward_backward(**shard(z.example_inputs, rank, world)), "grads": grads(z.model)}
    clear(z.model)
    shorter = {k: v[:, :16].contiguous() for k, v in z.example_inputs.items()}
    out["recaptured_loss"] = opt.forward_backward(**shard(shorter, rank, world))
    out["recaptured_grads"] = grads(z.model)
    out["link"] = calibrate_link(dist.group.WORLD, large_bytes=4 << 20, repeats=3)
    return out


def precision_checkpoint_checks(rank: int, world: int, batch: int) -> dict:
    """fuse + precision + checkpoint + Overlap: the averaged gradients of the same optimized step."""
    z = zoo.build("llama-tiny", batch=batch)
    passes = ["fuse", "precision", Checkpoint(budget=0.9), Overlap(**SMALL_BUCKETS)]
    opt = picofx.optimize(z.model, shard(z.example_inputs, rank, world), passes, backend="eager", loss_fn=z.loss_fn)
    return {"loss": opt.forward_backward(**shard(z.example_inputs, rank, world)), "grads": grads(z.model),
            "passes": [r.name for r in opt.report.records]}


def mismatched_layout(rank: int, world: int) -> None:
    """Rank 1 freezes one parameter: every rank must refuse before any all-reduce."""
    z = zoo.build("llama-tiny", batch=2)
    if rank == 1:
        z.model.get_parameter("decoder_layers.1.mlp.up_proj.weight").requires_grad_(False)
    picofx.optimize(z.model, z.example_inputs, [Overlap()], backend="eager", loss_fn=z.loss_fn)


def mismatched_warmup(rank: int, world: int) -> None:
    """The ranks give different compression warm-ups: they would switch to the compressed step at
    different steps, so every rank must refuse before the first."""
    z = zoo.build("llama-tiny", batch=2)
    picofx.optimize(z.model, z.example_inputs, [Overlap(compress="topk:0.01", warmup=1 + rank)], backend="eager",
                    loss_fn=z.loss_fn)


def inductor_checks(rank: int, world: int, batch: int) -> dict:
    """Overlap under Inductor: gradients, the generated backward's order of issue, compute and
    wait, and no_sync accumulation."""
    from torch._inductor.utils import run_and_get_code

    z = zoo.build("llama-tiny", batch=batch)
    local = shard(z.example_inputs, rank, world)
    opt, code = run_and_get_code(lambda: picofx.optimize(z.model, local, [Overlap(**SMALL_BUCKETS)],
                                                         backend="inductor", loss_fn=z.loss_fn))
    out = {"loss": opt.forward_backward(**local), "grads": grads(z.model), "code": code}
    clear(z.model)  # no_sync's variants compiled by Inductor: the pending buffers are graph constants there
    with opt.no_sync():
        opt.forward_backward(**local)
    opt.forward_backward(**shard(later_batch(z.example_inputs, 3), rank, world))
    out["accumulated"] = grads(z.model)
    return out
