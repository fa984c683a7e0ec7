"""`picofx.plan(model, world=N, ...)`: the layouts `picofx plan` ranks, in Python, and the passes
and mesh that run the best of them.

    plans = picofx.plan(model, world=8, seq=4096, global_batch=256, gpu="h100")
    plans.best                     # the fastest plan that fits, as `picofx plan --json` writes it
    made = plans.recipe()          # its passes and mesh (picofx.planner.recipe)
    opt = picofx.optimize(model, batch, passes=made.passes, mesh=made.mesh())

The ranking is `picofx plan`'s own (picofx.planner.run.plan_run); the passes and mesh of a plan are
the one recipe's (picofx.planner.recipe). On the CPU (gpu "cpu", or None where torch sees no GPU) the
device is calibrated here as `picofx plan --measure` calibrates it: one measured single-rank step of
the model, and the link of the ranks (`link`: rates measured by `picofx.cost.device.calibrate_link`
in the caller's process group; else measured on `world` gloo ranks spawned for it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from picofx.cost.device import Device, device_for, devices
from picofx.models.llama import LlamaConfig
from picofx.planner.compress import kinds_to_consider
from picofx.planner.costs import PASSES
from picofx.planner.layouts import LAYOUT_NAMES, Checkpointing, Layout, Prediction, Run
from picofx.planner.device_profile import read_device_profile
from picofx.planner.measure import calibrated_device
from picofx.planner.models import HF_KEYS, hf_config, model_config
from picofx.planner.recipe import Recipe, planned_recipe
from picofx.planner.run import check_run, on_network, plan_run, table

LAYOUT_FIELDS = set(LAYOUT_NAMES)


def as_config(model) -> LlamaConfig:
    """A zoo name or config path, a LlamaConfig, a Hugging Face config, or a model with a `.config` of either."""
    if isinstance(model, str):
        return model_config(model)
    if isinstance(model, LlamaConfig):
        return model
    config = getattr(model, "config", model)
    if isinstance(config, LlamaConfig):
        return config
    if all(hasattr(config, key) for key in ("hidden_size", "num_hidden_layers", "num_attention_heads")):
        return hf_config({key: getattr(config, key, None) for key in (*HF_KEYS.values(), "tie_word_embeddings")})
    raise TypeError(f"picofx.plan: {type(model).__name__} is not a LLaMA-shaped model the planner knows: pass a "
                    "zoo name, a LlamaConfig, a Hugging Face config, or a model with a .config of one")


@dataclass
class Plans:
    """The ranked plans: `predictions` (picofx.planner.layouts.Prediction), fastest fitting first,
    then those that do not fit; `compute_passes`: the passes the predictions assumed."""

    run: Run
    predictions: list[Prediction]
    compute_passes: tuple

    @property
    def plans(self) -> list[dict]:
        return [p.as_json() for p in self.predictions]

    @property
    def best_index(self) -> int | None:
        return next((i for i, p in enumerate(self.predictions) if p.fits), None)

    @property
    def best(self) -> dict | None:
        index = self.best_index
        return None if index is None else self.plans[index]

    def _chosen(self, index: int | None) -> Prediction:
        index = self.best_index if index is None else index
        if index is None:
            raise ValueError(f"picofx.plan: no plan fits {self.run.device.name}; the smallest needs "
                             f"{min(p.memory_per_gpu for p in self.predictions) / 1e9:.1f} GB per GPU")
        return self.predictions[index]

    def recipe(self, index: int | None = None) -> Recipe:
        """The passes and mesh of plan `index` (default: the best)."""
        return planned_recipe(self._chosen(index).layout, self.run.device, self.compute_passes)

    def passes(self, index: int | None = None) -> list:
        """The passes of plan `index` (default: the best) for picofx.optimize."""
        return self.recipe(index).passes

    def mesh_shape(self, index: int | None = None) -> dict:
        """ParallelMesh.build(**shape) of plan `index` (default: the best)."""
        return self.recipe(index).mesh_shape

    def table(self, top: int = 10) -> str:
        return table(self.predictions, top)

    def __len__(self) -> int:
        return len(self.predictions)


def _device(gpu, config: LlamaConfig, world: int, link, say):
    """The device the plans are predicted for, and the passes its costs assume."""
    if isinstance(gpu, Device):
        return gpu, PASSES
    if gpu is None:
        gpu = "cuda" if torch.cuda.is_available() else "cpu"
    if gpu == "cpu":
        stored = read_device_profile(world)  # picofx train --profile --calibrate's, on this machine
        if stored is not None:
            say(f"device: {stored[1]} (delete the file to measure again)")
        return (stored[0] if stored else calibrated_device(config, world, link=link, say=say)), ("fuse",)
    if gpu.startswith("cuda"):
        return device_for(gpu), PASSES
    if gpu not in devices():
        raise ValueError(f"picofx.plan: gpu {gpu!r}; one of {', '.join(devices())}, 'cpu', 'cuda' or a Device")
    return devices()[gpu], PASSES


def _allowed(layout: Layout, limits: dict) -> bool:
    for name, wanted in limits.items():
        value = getattr(layout, name)
        if name == "checkpoint" and not callable(wanted):  # True/False and the names, as Layout takes them
            wanted = [Checkpointing.of(w) for w in wanted] if isinstance(wanted, (list, tuple, set, frozenset)) \
                else Checkpointing.of(wanted)
        if callable(wanted):
            if not wanted(value):
                return False
        elif isinstance(wanted, (list, tuple, set, frozenset)):
            if value not in wanted:
                return False
        elif value != wanted:
            return False
    return True


def plan(model, *, world: int, seq: int, global_batch: int, gpu=None, gpus_per_node: int | None = None,
         memory: int | None = None, link: dict | None = None, compress=None, network: str | None = None, say=print,
         **limits) -> Plans:
    """Every layout of `model` training over `world` GPUs, predicted and ranked as `picofx plan` ranks them.

    model: an nn.Module (with a LlamaConfig or Hugging Face `.config`), a zoo name, a config file or
    a LlamaConfig. gpu: "h100", "h200", "a100", "cpu" (calibrated here), "cuda" (this machine's GPU),
    a picofx Device, or None (cuda if torch sees one, else cpu). memory: bytes per GPU instead of the
    device's. network: the cluster's network between nodes, a picofx.cost.gpus.NETWORKS key ("ib-hdr",
    "efa-p4d", ...) instead of the GPU profile's. compress: the gradient compressors replicated
    layouts are also planned with, as Overlap(compress=...) spells them: a name, "a,b" or a
    collection (None: bf16, int8 and sparse_rows on a GPU, none on the CPU; lossy "topk:F",
    "powersgd:R" only when listed). limits: Layout fields the plans must have, each a value, a
    collection of values or a predicate (tp=1, pp=(1, 2), shard=True, microbatches=lambda m: m <= 8)."""
    unknown = set(limits) - LAYOUT_FIELDS
    if unknown:
        raise TypeError(f"picofx.plan: unknown limits {sorted(unknown)}; limits are Layout fields: "
                        f"{sorted(LAYOUT_FIELDS)}")
    config = as_config(model)
    check_run(config, model if isinstance(model, str) else "the model", gpus=world,
              gpus_per_node=gpus_per_node or min(world, 8), seq=seq, global_batch=global_batch)
    on_cpu = gpu == "cpu" or (gpu is None and not torch.cuda.is_available()) or \
        (isinstance(gpu, Device) and "cpu" in gpu.name.lower())
    kinds = kinds_to_consider(compress, on_cpu=on_cpu)
    device, compute = _device(gpu, config, world, link, say)
    if network is not None:
        device = on_network(device, network, device.name, "picofx.plan's network")
    if memory is not None:
        device = dataclasses.replace(device, memory_capacity=memory)
    run, predictions = plan_run(config, gpus=world, gpus_per_node=gpus_per_node or min(world, 8), seq=seq,
                                global_batch=global_batch, device=device, passes=compute, compress=kinds)
    kept = [p for p in predictions if _allowed(p.layout, limits)]
    if not kept:
        raise ValueError(f"picofx.plan: no layout of {world} GPUs with a global batch of {global_batch}"
                         + (f" within the limits {limits}" if limits else "") + ": the batch must divide over the "
                         "data-parallel ranks and their micro-batches")
    return Plans(run, kept, compute)
