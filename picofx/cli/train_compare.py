"""picofx train --profile's prediction beside the measurement: the planner's prediction of the layout
that ran (picofx.plan limited to it, on this machine's calibrated device profile where --calibrate
stored one, else the device's nominal figures), component by component against rank 0's measured
mean; --calibrate's new device profile; under --pp the stages' measured balance against the cut's."""
from __future__ import annotations

from picofx.diagnose.profiler import milliseconds as seconds

# The planner's time terms that the trace measures as one component.
COMPUTE = ("compute", "recompute")
COMMUNICATION = ("tensor_parallel_comm", "context_parallel_comm", "pipeline_sends", "bubble",
                 "data_parallel_exposed", "compression")


def predicted_layout(args, ran, device):
    """The planner's Prediction of `ran`, the Layout that ran (None where it plans no such layout)."""
    import picofx
    from picofx.cli.train_model import planned_shape
    from picofx.planner.layouts import Checkpointing

    config, _ = planned_shape(args)
    same = dict(dp=ran.dp, tp=ran.tp, pp=ran.pp, shard=ran.shard, cp=ran.cp, precision=ran.precision)
    if ran.pp > 1:
        same.update(microbatches=ran.microbatches, schedule=ran.schedule)
    plans = picofx.plan(config, world=args.world, seq=args.seq, global_batch=args.batch * ran.dp, gpu=device,
                        say=lambda *a: None, **same)
    return next((p for p in plans.predictions if p.layout.checkpoint == Checkpointing.NONE
                 and p.layout.compress == ran.compress), None)


def device_to_predict_with(args):
    """(Device, where it comes from): the stored calibration for this many ranks on a CPU, else the
    device's own figures."""
    from picofx.cost.device import device_for
    from picofx.planner.device_profile import read_device_profile

    stored = read_device_profile(args.world) if args.device == "cpu" else None
    if stored is not None:
        return stored
    device = device_for(args.device)
    return device, f"{device.name}, {device.source}"


def components(prediction) -> dict:
    t = prediction.time
    return {"compute": sum(t.get(k, 0.0) for k in COMPUTE), "optimizer": t.get("optimizer", 0.0),
            "exposed_comm": sum(t.get(k, 0.0) for k in COMMUNICATION), "step": prediction.step_s}


def measured_components(mean: dict) -> dict:
    return {"compute": mean["forward"] + mean["backward"], "optimizer": mean["optimizer"],
            "exposed_comm": mean["exposed_comm"], "step": mean["seconds"] - mean["data"] - mean["checkpoint"]}


def compare_with_plan(args, layout, session, every: list[dict], found: dict) -> list[str]:
    """The summary's line of predicted against measured for `layout`, the run's; `found` gets the
    prediction's components."""
    mean = every[0]["mean"]
    if not mean:
        return []
    device, source = device_to_predict_with(args)
    try:
        prediction = predicted_layout(args, layout, device)
    except Exception as e:  # noqa: BLE001  a summary line, not a failed run
        return [f"  predicted: the planner could not predict this layout ({type(e).__name__}: {e})"]
    if prediction is None:
        return ["  predicted: the planner plans no layout like this run's (its options are not a planner Layout)"]
    predicted, measured = components(prediction), measured_components(mean)
    found.update(predicted)
    parts = [f"{name} {seconds(predicted[name])} predicted, {seconds(measured[name])} measured"
             f"{ratio(measured[name], predicted[name])}" for name in ("step", "compute", "optimizer", "exposed_comm")]
    lines = [f"  predicted against measured (rank 0, per step, data wait and checkpoint aside; device {source}): "
             + "; ".join(parts)]
    if args.calibrate:
        lines.append("  " + calibrate(args, layout, device, prediction, predicted, measured, session, every))
    return lines


def ratio(measured: float, predicted: float) -> str:
    if predicted <= 0 or measured <= 0:
        return ""
    return f" ({measured / predicted:.2g}x)"


def calibrate(args, layout, device, prediction, predicted: dict, measured: dict, session, every: list[dict]) -> str:
    """A device whose compute and optimizer rates give the measured times and whose link the traced
    collectives' rates (picofx.cli.train_link), stored for `picofx plan`."""
    from picofx.cli.train_link import measured_link
    from picofx.planner.device_profile import scaled, with_link, write_device_profile

    if args.device != "cpu":
        return "--calibrate: device profiles are kept for the CPU only (a GPU's are its datasheet's)"
    if predicted["compute"] <= 0 or measured["compute"] <= 0:
        return "--calibrate: no compute measured or predicted; nothing written"
    factor = measured["compute"] / predicted["compute"]
    tensors = sum(1 for _ in session.opt_model.parameters()) or 1
    first = scaled(device, factor, device.optimizer_tensor_overhead)
    again = components(predicted_layout(args, layout, first))
    overhead = device.optimizer_tensor_overhead + (measured["optimizer"] - again["optimizer"]) / tensors
    how = f"picofx train --profile {args.profile} --calibrate on {args.world} rank(s)"
    links = measured_link(args, layout, every)
    calibrated = with_link(scaled(device, factor, overhead), links.levels, how)
    path = write_device_profile(calibrated, args.world, how, communication=links.dimensions)
    return (f"calibrated: compute {factor:.3g}x the device's figures, AdamW {overhead * 1e6:.0f} us per tensor; "
            f"{links.said}; written to {path}: picofx plan on this machine predicts {args.world}-rank layouts with it")


def stage_balance_lines(every: list[dict]) -> list[str]:
    """Under --pp: each stage's share of the forward + backward time, measured and as the cut predicted."""
    by_stages: dict[tuple, list] = {}
    for figures in every:
        stages = figures.get("stages") or {}
        if stages:
            by_stages.setdefault(tuple(stages["stages"]), []).append(stages)
    if len(by_stages) < 2:
        return []
    order = sorted(by_stages)
    measured = [sum(s["measured_s"] for s in by_stages[k]) / len(by_stages[k]) for k in order]
    predicted = [sum(s["predicted_s"] for s in by_stages[k]) / len(by_stages[k]) for k in order]
    share = lambda values: "/".join(f"{100 * v / (sum(values) or 1):.0f}%" for v in values)  # noqa: E731
    spread = lambda values: 100 * (max(values) / (sum(values) / len(values)) - 1)  # noqa: E731
    names = "/".join("+".join(str(i) for i in k) for k in order)
    return [f"  pipeline stages {names}: measured shares of forward + backward {share(measured)}, the cut predicted "
            f"{share(predicted)}; the slowest stage {spread(measured):.0f}% above the mean "
            f"(predicted {spread(predicted):.0f}%)"]
