"""This machine's CPU as a run measured it: `picofx train --profile N --calibrate` writes a Device whose
compute and optimizer rates make the planner's prediction of the run's own layout equal to what the
trace measured and whose links have the rates of the collectives it traced (`with_link`: the in-node
link and the network, each from the mesh dimensions whose groups ride it), and `picofx plan`
(picofx.plan with gpu="cpu") on this machine predicts with it instead of measuring a step of its own.
Stored in picofx's cache directory (`devices/`, beside the measured CPU peak's `peaks/` and the graph
cache), keyed by the machine, its CPU, torch and the number of ranks; delete the file to measure again.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib

import torch

from picofx.cost.hardware import Device


def profile_path(ranks: int) -> pathlib.Path:
    from picofx.runtime.peaks import machine_file

    return machine_file("devices", f"{ranks} ranks")


def write_device_profile(device: Device, ranks: int, how: str, communication: dict | None = None) -> pathlib.Path:
    """Stores `device` for plans of `ranks` ranks on this machine; returns the file. `communication`: the
    measured links per mesh dimension (picofx.cli.train_link's), kept beside the device for the reader."""
    fields = dataclasses.asdict(device)
    fields["peak_flops"] = {str(dtype).removeprefix("torch."): flops for dtype, flops in device.peak_flops.items()}
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    path = profile_path(ranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    stored = {"device": fields, "measured": when, "how": how}
    if communication:
        stored["communication"] = communication
    partial.write_text(json.dumps(stored, indent=1))
    partial.replace(path)
    return path


def read_device_profile(ranks: int) -> tuple[Device, str] | None:
    """(the stored Device, when and how it was measured), or None where none is stored or it cannot be read."""
    path = profile_path(ranks)
    try:
        found = json.loads(path.read_text())
        fields = dict(found["device"])
        fields["peak_flops"] = {getattr(torch, name): float(flops) for name, flops in fields["peak_flops"].items()}
        return Device(**fields), f"{path}: measured {found['measured']} by {found['how']}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def scaled(device: Device, compute: float, optimizer_tensor_overhead: float) -> Device:
    """`device` whose compute takes `compute` times as long (FLOP/s, memory bandwidth and per-op
    overhead scaled alike) with the optimizer's per-tensor overhead given."""
    return dataclasses.replace(device, peak_flops={d: f / compute for d, f in device.peak_flops.items()},
                               memory_bandwidth=device.memory_bandwidth / compute,
                               op_overhead=device.op_overhead * compute,
                               optimizer_tensor_overhead=max(0.0, optimizer_tensor_overhead),
                               name=device.name.replace(", nominal", "") + ", calibrated by a run",
                               source="calibrated: picofx train --profile --calibrate")


def with_link(device: Device, levels: dict, how: str) -> Device:
    """`device` whose in-node link ("node") and network ("network") have the measured bandwidth and
    ring-step latency of `levels` (picofx.cli.train_link's fits, each naming the mesh dimensions it
    was fitted to), the per-collective latency folded into the steps'; a level not given keeps the
    device's figures; `device` itself where none is given."""
    node, network = levels.get("node"), levels.get("network")
    if node is None and network is None:
        return device

    def name(link: dict) -> str:
        kinds = ", ".join(k.replace("_", "-") + "s" for k in link.get("kinds", ()))
        return f"gloo, measured on {' and '.join(link.get('dims', ()))} ({kinds})"
    fields = {"collective_latency": 0.0, "link_source": f"calibrated: {how}"}
    if node is not None:
        fields.update(link_bandwidth=node["bandwidth"], link_latency=node["latency_s"], link_name=name(node))
    if network is not None:
        fields.update(network_bandwidth=network["bandwidth"], network_latency=network["latency_s"],
                      network_name=name(network))
    return dataclasses.replace(device, **fields)
