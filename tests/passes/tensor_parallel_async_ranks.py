"""What each of two gloo ranks runs for tests/passes/test_tensor_parallel_async.py: one step of
sequence-parallel TensorParallel with and without async_overlap, every rank the same batch."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import picofx
from picofx.models import real_models, zoo
from picofx.passes import TensorParallel

BUILDS = {"reference": lambda: zoo.build("llama-tiny"), "hf": lambda: real_models.hf_model("llama")}
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor", "sp_gather", "sp_scatter")


def one_step(case: str, backend: str, async_overlap: bool) -> dict:
    torch.manual_seed(0)
    z = BUILDS[case]()
    opt = picofx.optimize(z.model, z.example_inputs, [TensorParallel(sequence_parallel=True,
                                                                      async_overlap=async_overlap), "fuse"],
                          backend=backend, loss_fn=z.loss_fn)
    out = opt(**dict(z.example_inputs))
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    order = {role: [n.target.__name__.split(".")[0] for n in g.graph.nodes if n.op == "call_function"
                    and n.target.__name__.split(".")[0] in COLLECTIVES + ("mm",)]
             for role, g in opt.graphs.items() if role in ("forward", "backward")}
    return {"loss": loss.detach(), "order": order,
            "grads": {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                      for n, p in z.model.named_parameters()},
            "chunked": [r.notes["chunked"] for r in opt.report.records if r.name == "tensor_parallel" and "chunked" in r.notes]}


def eager(rank: int, world: int) -> dict:
    return {(case, flag): one_step(case, "eager", flag) for case in BUILDS for flag in (False, True)}


def inductor(rank: int, world: int) -> dict:
    """The reference model under Inductor without and with async_overlap, and the code generated for the latter."""
    from torch._inductor.utils import run_and_get_code

    out = {False: one_step("reference", "inductor", False)}
    out[True], code = run_and_get_code(lambda: one_step("reference", "inductor", True))
    out["code"] = "\n".join(code)
    return out
