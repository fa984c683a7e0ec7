"""What each rank runs in the float8-gather tests of the shard pass (spawned: importable functions).

Each returns plain tensors and facts; the test process compares them with one process running the
same float8 recipe."""
from __future__ import annotations

import warnings

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._python_dispatch import TorchDispatchMode

import picofx
from picofx.models import real_models, zoo
from picofx.passes import Precision, Shard

from overlap_ranks import shard
from shard_ranks import gathered_grads

BATCH = 4  # two ranks of 2


def float8_model(name: str = "llama"):
    """The reference LLaMA, or HF Qwen2 (biased q, k, v) with its output projection tied to the embedding."""
    if name == "llama":
        return zoo.reference_llama("tiny", batch=BATCH, seq=24)
    return real_models.hf_model("qwen2", batch=BATCH, seq=24, tie_word_embeddings=True)


def optimize(z, inputs, passes):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Precision\(float8=...\) on the CPU")
        return picofx.optimize(z.model, inputs, passes, backend="eager", loss_fn=z.loss_fn)


def passes(recipe: str = "tensorwise", **shard):
    return [Precision(dtype="fp32", float8=recipe, float8_layers="all"), Shard(**shard)]


class ForwardWeights(TorchDispatchMode):
    """Each forward float8 matmul's weight operand (transposed back) and its inverse scale, as run."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_mm.default and kwargs.get("use_fast_accum", args[7:8] == (True,)):
            self.seen.append((args[1].t().clone(), (kwargs["scale_b"] if "scale_b" in kwargs else args[3]).clone()))
        return func(*args, **kwargs)


def one_step(rank: int, world: int, model: str = "llama", recipe: str = "tensorwise", **shard_options) -> dict:
    """Loss and gathered gradients of one step, the float8 weights the forward's matmuls read, and
    the shard pass's notes."""
    z = float8_model(model)
    inputs = shard(z.example_inputs, rank, world)
    opt = optimize(z, inputs, passes(recipe, **shard_options))
    with ForwardWeights() as weights:
        loss = opt.forward_backward(**inputs)
    notes = next(r.notes for r in opt.report.records if r.name == "shard" and "gathers" in r.notes)
    return {"loss": loss.detach(), "grads": gathered_grads(z.model), "weights": weights.seen,
            "gathers": notes["gathers"], "float8_gathered": notes["float8_gathered"],
            "float8_kept": notes["float8_kept"]}


def one_step_kept(rank: int, world: int) -> dict:
    return one_step(rank, world, reshard_after_forward=False)


def one_step_bf16(rank: int, world: int) -> dict:
    """Gradients reduce-scattered in bf16, one gather per parameter."""
    return one_step(rank, world, mixed_precision=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16), bucket=0)


def one_step_qwen2_tied(rank: int, world: int) -> dict:
    return one_step(rank, world, "qwen2")


def one_step_rowwise(rank: int, world: int) -> dict:
    return one_step(rank, world, recipe="rowwise")
