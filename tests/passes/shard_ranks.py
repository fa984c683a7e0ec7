"""What each rank runs in the shard tests (spawned: these functions must be importable).

Each returns plain tensors and facts (gathered gradients as full tensors); the test process
compares them with single-process references."""
from __future__ import annotations

import time

import torch
from torch.distributed.tensor import DTensor

import picofx
from picofx.examples import zoo
from picofx.passes import Shard
from picofx.runtime.shard import local_bytes
from picofx.capture.vocabulary import viewed_source
from picofx.testing import op_counts

from overlap_ranks import clear, later_batch, shard


WAIT = torch.ops._c10d_functional.wait_tensor.default


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def gathered_grads(model) -> dict:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def saved_gathers(forward_graph) -> int:
    """How many of the forward graph's outputs (what the backward reads) are gathered parameters."""
    count = 0
    for node in forward_graph.graph.output_node().args[0]:
        source = viewed_source(node) if isinstance(node, torch.fx.Node) else None
        if source is not None and source.target == WAIT and "all_gather" in str(source.args[0].target):
            count += 1
    return count


def facts(model) -> dict:
    """Where the parameters and gradients live after a sharded step."""
    params = dict(model.named_parameters())
    return {"dtensor_params": all(isinstance(p, DTensor) for p in params.values()),
            "dtensor_grads": all(isinstance(p.grad, DTensor) for p in params.values() if p.grad is not None),
            "placements": sorted({str(p.placements) for p in params.values() if isinstance(p, DTensor)}),
            "local_bytes": local_bytes(model),
            "local_grad_bytes": sum(p.grad.to_local().numel() * 4 for p in params.values() if p.grad is not None)}


def reference_llama_checks(rank: int, world: int, batch: int, backend: str = "eager") -> dict:
    """Shard on the reference LLaMA: one step (loss, gathered gradients, where they live), the
    graphs' collectives, then AdamW steps (gathered parameters)."""
    z = zoo.build("llama-tiny", batch=batch)
    full_bytes = local_bytes(z.model)
    names = [n for n, _ in z.model.named_parameters()]
    opt = picofx.optimize(z.model, shard(z.example_inputs, rank, world), [Shard()], backend=backend,
                          loss_fn=z.loss_fn)
    out = {"forward_ops": op_counts(opt.graphs["forward"]), "backward_ops": op_counts(opt.graphs["backward"]),
           "saved_gathers": saved_gathers(opt.graphs["forward"]),
           "notes": {r.name + "." + r.graph_role: r.notes for r in opt.report.records}, "full_bytes": full_bytes}
    out["loss"] = opt.forward_backward(**shard(z.example_inputs, rank, world))
    out["grads"] = gathered_grads(z.model)
    out.update(facts(z.model))
    out["names"] = (names, [n for n, _ in opt.named_parameters()])
    optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-3)
    for step in range(3):
        clear(z.model)
        opt.forward_backward(**shard(later_batch(z.example_inputs, step + 5), rank, world))
        optimizer.step()
    out["params"] = {n: full(p) for n, p in z.model.named_parameters()}
    return out
