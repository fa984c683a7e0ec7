"""Every layout of a training run, predicted and ranked with its suggestions, and the tables that show
them: what `picofx plan`, `picofx.plan(...)` and `picofx train --layout auto` plan with."""
from __future__ import annotations

import torch

from picofx.cost.device import devices
from picofx.cost.gpus import NETWORKS, GpuProfile
from picofx.cost.model import CostModel
from picofx.models.llama import LlamaConfig
from picofx.planner.compress import kinds_to_consider
from picofx.planner.costs import PASSES, model_costs
from picofx.planner.layouts import Layout, Prediction, Run, predict, valid
from picofx.planner.search import plan_layouts
from picofx.planner.models import model_config
from picofx.planner.suggest import with_suggestions


def check_run(config: LlamaConfig, name: str, *, gpus: int, gpus_per_node: int, seq: int, global_batch: int) -> None:
    """Refuse, naming what to change, a run the planner cannot plan (ValueError)."""
    for what, value in (("the number of GPUs", gpus), ("GPUs per node", gpus_per_node), ("the sequence length", seq),
                        ("the global batch", global_batch)):
        if value < 1:
            raise ValueError(f"{what} must be at least 1, got {value}")
    limit = config.max_position_embeddings
    if seq > limit:
        raise ValueError(f"a sequence of {seq:,} tokens is longer than {name}'s {limit:,} positions "
                         f"(max_position_embeddings): plan sequences of at most {limit:,} tokens, or a model "
                         "configured for longer ones")


def make_run(model, *, gpus: int, gpu: str = "h100", gpus_per_node: int = 8, seq: int = 4096, global_batch: int,
             device=None, passes=PASSES, network: str | None = None, say=None) -> Run:
    """The Run of `model` (a name or path as `picofx plan` takes it, or a LlamaConfig) over `gpus`: its
    costs captured once. `device`: a picofx.cost.device.Device instead of the `gpu` kind's entry;
    `network`: the cluster's network between nodes (picofx.cost.gpus.NETWORKS) instead of the profile's;
    `say(text)`: hears of each step that takes a while (the captures)."""
    config = model if isinstance(model, LlamaConfig) else model_config(model)
    check_run(config, model if isinstance(model, str) else "the model", gpus=gpus, gpus_per_node=gpus_per_node,
              seq=seq, global_batch=global_batch)
    device = device or gpu_profile(gpu, network)
    return Run(model_costs(config, seq, CostModel(device), passes, say), device, gpus, min(gpus_per_node, gpus),
               global_batch)


def gpu_profile(name: str, network: str | None = None):
    """The device profile `name` (picofx plan --list-gpus), on `network` where given, or ValueError
    naming them."""
    known = devices()
    if name not in known:
        raise ValueError(f"--gpu {name!r}: one of {', '.join(known)} (picofx plan --list-gpus)")
    return known[name] if network is None else on_network(known[name], network, f"--gpu {name}")


def on_network(device, network: str, what: str, option: str = "--network"):
    """`device` in a cluster joined by NETWORKS[`network`], or ValueError naming the networks (an
    unknown one) or saying `what` has none to replace (a device that is not a GPU profile)."""
    if network not in NETWORKS:
        raise ValueError(f"{option} {network!r}: one of {', '.join(NETWORKS)} (picofx plan --list-gpus)")
    if not isinstance(device, GpuProfile):
        raise ValueError(f"{option} {network}: {what} has no network between nodes to replace; "
                         f"leave {option} out")
    return device.on(NETWORKS[network])


def compressors(gpu: str, device, compress) -> tuple:
    """The compressors replicated layouts are planned with (picofx.planner.compress.kinds_to_consider)."""
    on_cpu = gpu == "cpu" if device is None else "cpu" in device.name.lower()
    return kinds_to_consider(compress, on_cpu=on_cpu)


def plan_run(model, *, gpus: int, gpu: str = "h100", gpus_per_node: int = 8, seq: int = 4096,
             global_batch: int, device=None, passes=PASSES, compress=None,
             network: str | None = None, say=None) -> tuple[Run, list[Prediction]]:
    """Every layout of `model` over `gpus`, predicted and ranked (those that fit first, fastest first),
    each with its suggestions. `compress`: the compressors replicated layouts are also planned with
    (picofx.planner.compress.kinds_to_consider; None: the device's defaults). `say(text)`: hears of
    each step before it starts."""
    kinds = compressors(gpu, device, compress)
    run = make_run(model, gpus=gpus, gpu=gpu, gpus_per_node=gpus_per_node, seq=seq, global_batch=global_batch,
                   device=device, passes=passes, network=network, say=say)
    if say:
        say("predicting every layout")
    predictions = plan_layouts(run, kinds)
    if say:
        say(f"predicting the neighbours of {len(predictions):,} layouts for their suggestions")
    return run, with_suggestions(run, predictions, kinds)


def plan_layout(model, layout: Layout, *, gpu: str = "h100", gpus_per_node: int = 8, seq: int = 4096,
                global_batch: int, device=None, passes=PASSES, compress=None,
                network: str | None = None, say=None) -> tuple[Run, Prediction]:
    """`layout` of `model` predicted as `plan_run` predicts it among the others, with its suggestions
    (its neighbours compared with the compressors `compress`); ValueError where the run cannot have it."""
    gpus = layout.gpus
    run = make_run(model, gpus=gpus, gpu=gpu, gpus_per_node=gpus_per_node, seq=seq, global_batch=global_batch,
                   device=device, passes=passes, network=network, say=say)
    why = valid(run, layout)
    if why is not None:
        raise ValueError(f"--layout {layout.describe()} cannot run {global_batch} sequences on {gpus} GPUs "
                         f"({run.gpus_per_node} per node): {why}")
    return run, with_suggestions(run, [predict(run, layout)], compressors(gpu, device, compress))[0]


def table(predictions: list[Prediction], top: int) -> str:
    """The first `top` plans, a row each, with the best suggestion under it."""
    width = max([42] + [len(p.layout.describe()) for p in predictions[:top]])  # cp layouts spell one more dimension
    head = (f"{'#':>3} {'layout':{width}s} {'GB/GPU':>7} {'step s':>8} {'tokens/s':>10} {'MFU':>6}  "
            f"{'fits':4s}  bottleneck")
    rows = [head, "-" * len(head)]
    for i, p in enumerate(predictions[:top]):
        rows.append(f"{i:>3} {p.layout.describe():{width}s} {p.memory_per_gpu / 1e9:7.1f} {p.step_s:8.3f} "
                    f"{p.tokens_per_s:10,.0f} {p.mfu:6.1%}  {'yes' if p.fits else 'no':4s}  {p.bottleneck}")
        if p.suggestions:
            rows.append(f"{'':>4}  -> {p.suggestions[0].describe(p)}")
    return "\n".join(rows)


def suggestions_table(p: Prediction) -> str:
    """Every suggestion of plan `p`, best first, a line each."""
    return "\n".join(f"  -> {s.describe(p)}" for s in p.suggestions)


def gpus_table() -> str:
    """The device profiles --gpu takes, with what each holds and where its figures come from."""
    rows = [f"{'--gpu':11s} {'device':34s} {'memory':>7s} {'bf16 TFLOP/s':>12s} {'HBM TB/s':>8s}  links; sources"]
    for key, d in devices().items():
        rows.append(f"{key:11s} {d.name:34s} {d.memory_capacity / 1e9:5.0f}GB "
                    f"{d.flops_per_second(torch.bfloat16) / 1e12:12.1f} {d.memory_bandwidth / 1e12:8.2f}  "
                    f"{d.link_name}, {d.network_name}; compute and memory: {d.source}; links: {d.link_source}")
    rows += ["", f"{'--network':11s} {'between nodes':45s} {'GB/s per node':>13s}  source"]
    for key, n in NETWORKS.items():
        rows.append(f"{key:11s} {n.name:45s} {n.ports * n.port_bandwidth / 1e9:13.0f}  {n.source}")
    return "\n".join(rows)


def measured_table(measured: list[Prediction]) -> str:
    """Predicted against measured: is each prediction within 35%, and is the plan predicted fastest
    within 15% of the measured fastest."""
    rows = [f"{'layout':42s} {'predicted s':>12} {'measured s':>11} {'error':>7}"]
    errors = []
    for p in measured:
        error = p.step_s / p.measured_step_s - 1
        errors.append(abs(error))
        rows.append(f"{p.layout.describe():42s} {p.step_s:12.4f} {p.measured_step_s:11.4f} {error:+7.0%}")
    fastest = min(p.measured_step_s for p in measured)
    chosen = measured[0].measured_step_s / fastest - 1
    rows.append(f"every prediction within 35%: {'yes' if max(errors) <= 0.35 else 'no'} (worst {max(errors):.0%}); "
                f"the plan predicted fastest is {chosen:.0%} slower than the measured fastest "
                f"({'within' if chosen <= 0.15 else 'outside'} 15%)")
    return "\n".join(rows)
