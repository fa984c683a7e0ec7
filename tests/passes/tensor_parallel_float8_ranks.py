"""What each of two gloo ranks runs for tests/passes/test_tensor_parallel_float8.py: the tiny LLaMA
under TensorParallel and Precision(float8=...), the same full batch on every rank; the loss, the
whole gradients and what the graphs gather go back to the test process."""
from __future__ import annotations

import warnings

import torch
from torch.distributed.tensor import DTensor

import picofx
from picofx.models import zoo
from picofx.passes import Precision, TensorParallel

c10d = torch.ops._c10d_functional
# The attention's projections: colwise (q, k, v) and rowwise (out). The MLP's hidden 176 splits into
# 88 per rank, which the float8 kernels cannot take (not a multiple of 16): those stay high precision.
ATTENTION = ["decoder_layers.*.attention.*"]


def gathers(gm: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """(dtype, bytes) of what each rank sends into each all-gather of a graph that runs."""
    sent = [n.args[0].meta["val"] for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    return [(str(t.dtype).replace("torch.", ""), t.numel() * t.element_size()) for t in sent]


def whole_gradients(model: torch.nn.Module) -> dict:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def one_step(precision: Precision, **tensor_parallel) -> dict:
    z = zoo.build("llama-tiny")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Precision\(float8=...\) on the CPU")
        opt = picofx.optimize(z.model, z.example_inputs, [TensorParallel(**tensor_parallel), precision],
                              backend="eager", loss_fn=z.loss_fn)
    loss = opt.forward_backward(**z.example_inputs)
    notes = next(r.notes for r in opt.report.records if r.name == "precision")
    return {"loss": loss.detach(), "float8_linears": notes.get("float8_linears", 0),
            "grads": whole_gradients(z.model),
            "gathers": {role: gathers(opt.graphs[role]) for role in ("forward", "backward")},
            "float8_gathers": notes.get("float8_gathers", 0),
            "amax_reductions": {role: sum(n.target is c10d.all_reduce.default and n.args[1] == "max"
                                          for n in opt.graphs[role].graph.nodes) for role in ("forward", "backward")},
            "scaled_mms": sum(n.target is torch.ops.aten._scaled_mm.default for n in opt.graphs["forward"].graph.nodes)}


def fp32_elsewhere(recipe: str) -> Precision:
    """float8's casts the only rounding: the pieces then equal one process bit for bit, bar sums' order."""
    return Precision(dtype="fp32", float8=recipe, float8_layers=ATTENTION)


def tensorwise(rank: int, world: int) -> dict:
    """Tensor parallel, and sequence parallel with its all-gathers in float8 (CI)."""
    return {"tp": one_step(fp32_elsewhere("tensorwise")),
            "sp": one_step(fp32_elsewhere("tensorwise"), sequence_parallel=True, async_overlap=False)}


def rowwise(rank: int, world: int) -> dict:
    """The rowwise recipes: tensor parallel, and sequence parallel (which gathers in fp32 for them)."""
    return {**{recipe: one_step(fp32_elsewhere(recipe)) for recipe in ("rowwise", "rowwise_with_gw_hp")},
            "sp rowwise": one_step(fp32_elsewhere("rowwise"), sequence_parallel=True, async_overlap=False)}


def inductor(rank: int, world: int) -> dict:
    """Sequence parallel with its chunked (async) collectives and the float8 gathers, compiled."""
    z = zoo.build("llama-tiny")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Precision\(float8=...\) on the CPU")
        opt = picofx.optimize(z.model, z.example_inputs, [TensorParallel(sequence_parallel=True),
                                                          fp32_elsewhere("tensorwise")], backend="inductor",
                              loss_fn=z.loss_fn)
    loss = opt.forward_backward(**z.example_inputs)
    return {"sp": {"loss": loss.detach(), "grads": whole_gradients(z.model)}}
