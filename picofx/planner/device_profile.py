"""This machine's CPU as a run measured it: `picofx train --profile N --calibrate` writes a Device whose
compute and optimizer rates make the planner's prediction of the run's own layout equal to what the
trace measured and whose link has the rates of the collectives it traced (`with_link`), and `picofx plan` (picofx.plan with gpu="cpu") on this machine predicts with it
instead of measuring a step of its own. Stored in picofx's cache directory (`devices/`, beside the
measured CPU peak's `peaks/` and the graph cache), keyed by the machine, its CPU, torch and the
number of ranks; delete the file to measure again.
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
    measured collectives' rates per mesh dimension (picofx.diagnose.collectives.link_rates), kept
    beside the device for the reader."""
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


LINK_KINDS = ("all_reduce", "all_gather", "reduce_scatter")  # the first with a bandwidth prices the link


def with_link(device: Device, rates: dict, how: str) -> Device:
    """`device` whose link (in the node and across nodes: one machine's gloo) has the bandwidth and
    ring-step latency of `rates` (link_rates' per kind), the per-collective latency folded into the
    steps'; `device` itself where no kind was timed with a bandwidth."""
    kind = next((k for k in LINK_KINDS if (rates.get(k) or {}).get("bandwidth")), None)
    if kind is None:
        return device
    bandwidth, latency = rates[kind]["bandwidth"], rates[kind]["latency_s"]
    return dataclasses.replace(device, link_bandwidth=bandwidth, link_latency=latency, network_bandwidth=bandwidth,
                               network_latency=latency, collective_latency=0.0,
                               link_name=f"gloo, measured ({kind.replace('_', '-')}s)", network_name="gloo, measured",
                               link_source=f"calibrated: {how}")
