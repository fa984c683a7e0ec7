"""picofx train --profile N: N steps traced with torch.profiler on every rank (one trace file per rank
in DIR/profile, DIR the --save directory or the working directory), where their time went on each rank
(picofx.diagnose.breakdown), per decoder layer and per pass (the graph node each op came from), the
planner's prediction of the same layout beside it, and under --pp each stage's measured time beside
the cut's prediction. It goes into the summary, into the --metrics lines of the traced steps (a
`breakdown` per rank: `picofx doctor` reads it back) and into the --report page.

--calibrate writes the measured rates (compute, optimizer, and the link's from the traced collectives:
picofx.cli.train_link) into this machine's device profile (picofx.planner.device_profile), which
`picofx plan` on the CPU then predicts with.
"""
from __future__ import annotations

import json
import math
import pathlib

from picofx.cli.train_link import traced_collectives
from picofx.diagnose.profiler import crash_records, milliseconds as seconds, profile, where_the_time_went

WAIT, WARMUP = 2, 1  # untraced steps before the window (capture, compilation, the workers' start), warm-up


def add_profile_options(p) -> None:
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="trace N steps with torch.profiler on every rank (DIR/profile/rank<r>.pt.trace.json, DIR the "
                        "--save directory or here) and say where their time went, per rank, layer and pass")
    p.add_argument("--calibrate", action="store_true",
                   help="with --profile: write the measured compute, optimizer and link rates into this machine's "
                        "device profile, which picofx plan then uses here")


def check_profile_options(args) -> None:
    if args.profile < 0:
        raise ValueError(f"--profile {args.profile}: the number of steps to trace, at least 1 (0: no trace)")
    if args.calibrate and not args.profile:
        raise ValueError("--calibrate measures the rates from a trace: pass --profile N too (e.g. --profile 3)")


def profile_directory(args) -> pathlib.Path:
    return pathlib.Path(args.save or ".") / "profile"


def armed(args):
    """`args`, with --profile on CUDA the crash records armed before the process group is made: a
    memory snapshot at an out-of-memory error and NCCL's flight recorder
    (picofx.diagnose.profiler.crash_records); nothing on a CPU."""
    import os

    if args.profile:
        crash_records(profile_directory(args), int(os.environ.get("RANK", "0")))
    return args


class RunProfile:
    """The run's profiler: inert without --profile. Its phases wrap the session's own methods (the
    batches' `next`, the step's `forward_backward`, the optimizer's `step`, the saves' `after_step`),
    so the loop only calls `step()` at the end of each step."""

    def __init__(self, args, session, saves):
        self.args, self.session, self.traced_steps, self.prof = args, session, [], None
        self.measured = None  # every rank's figures, on rank 0 after finish
        self.predicted: dict = {}  # the planner's prediction of the layout, by component (seconds)
        run_steps = args.steps - session.start_step
        if not args.profile:
            return
        steps = min(args.profile, run_steps)
        warmup = WARMUP if run_steps > steps else 0
        graphs = session.opt_model.graphs if session.opt_model.pipeline is None else None
        self.prof = profile(steps, wait=min(WAIT, run_steps - steps - warmup), warmup=warmup,
                            directory=profile_directory(args), graphs=graphs, shapes=args.calibrate).__enter__()
        for owner, method, phase in ((session.batches, "next", "data"), (session.opt_model, "forward_backward",
                                     "forward_backward"), (session.optimizer, "step", "optimizer"),
                                     (saves, "after_step", "checkpoint")):
            self.prof.wrap(owner, method, phase)

    def end_step(self, step: int, save) -> bool:
        """`save(step)` (the checkpoint due after `step`, numbered from 1 as the records are, inside the
        step's trace), then the profiler's step ends; returns what `save` returned."""
        stop = save(step)
        if self.prof is not None:
            if self.prof.recording:
                self.traced_steps.append(step)
            self.prof.step()
        return stop

    def finish(self, ranks, metrics, records: list[dict]) -> list[str]:
        """Every rank (one gather): the summary's lines on rank 0; the traced steps' breakdowns appended
        to the --metrics file. Nothing without --profile."""
        if self.prof is None:
            return []
        self.prof.__exit__(None, None, None)
        del self.prof.breakdowns[len(self.traced_steps):]  # stopped in the window: the step begun after the last
        mine = {"steps": [b.as_dict() for b in self.prof.breakdowns], "mean": self.prof.mean(),
                "attribution": self.prof.attribution, "stages": stage_times(self.session, self.prof.mean()),
                **traced_collectives(self.args, self.prof.collectives, self.session.opt_model)}  # --calibrate's
        every = gather(mine, ranks.world)
        if every is None:
            return []
        write_breakdowns(metrics.file if metrics is not None else None, records, self.traced_steps, every)
        traces = profile_directory(self.args)
        lines = [f"where the time went ({len(self.traced_steps)} traced steps, traces in {traces}):"]
        lines += [f"  rank {r}: {where_the_time_went(figures['mean'])}" for r, figures in enumerate(every)]
        lines += layers_line(every[0]["attribution"])
        lines += predicted_lines(self.args, ranks.layout, self.session, every, self.predicted)
        self.measured = every
        return lines

    def stop(self, ranks, metrics, records: list[dict]) -> None:
        """The run stopped by SIGTERM or Ctrl-C (every rank at one step): --profile's figures of the
        steps traced so far, said and written as at the end of a run (the trace, the summary's
        lines, the --metrics lines)."""
        for line in self.finish(ranks, metrics, records):
            ranks.say(f"  {line}")

    @property
    def html(self) -> dict:
        """Report.to_html's `measured` (each rank's measured step beside the predicted one), or nothing."""
        if not self.measured:
            return {}
        return {"measured": {"ranks": [figures["mean"] for figures in self.measured],
                             "predicted": self.predicted or None}}


def gather(mine: dict, world: int) -> list[dict] | None:
    """Every rank's figures on rank 0 (None on the others): one gather_object, after the loop."""
    if world == 1:
        return [mine]
    import torch.distributed as dist

    every = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    return every


def write_breakdowns(file, records: list[dict], traced: list[int], every: list[dict]) -> None:
    """Each traced step's record again, with `breakdown`: each rank's components that step (a step
    logged twice keeps its last line, so readers see this one)."""
    by_step = {r.get("step"): r for r in records}
    for index, step in enumerate(traced):
        if step not in by_step:
            continue
        per_rank = [figures["steps"][index] if index < len(figures["steps"]) else None for figures in every]
        by_step[step]["breakdown"] = per_rank  # the summary's detectors read it too
        if file is not None:
            line = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in by_step[step].items()}
            file.write(json.dumps({**line, "stages": [f["stages"] for f in every]}) + "\n")  # JSON has no NaN
    if file is not None:
        file.flush()


def layers_line(attribution: dict) -> list[str]:
    if not attribution:
        return []
    total = sum(attribution["by_layer"].values()) or 1.0
    layers = ", ".join(f"{name} {100 * s / total:.0f}%" for name, s in sorted(attribution["by_layer"].items()))
    passes = ", ".join(f"{name} {100 * s / total:.0f}%" for name, s in sorted(attribution["by_pass"].items()))
    return [f"  rank 0's ops by layer: {layers}; by pass: {passes}; "
            f"{seconds(attribution['unattributed'])} a step of op time matched to no graph node"]


def stage_times(session, mean: dict) -> dict:
    """Under a pipeline: this rank's stages, their predicted seconds for one micro-batch (the cut's
    cost model) and the rank's measured forward + backward per traced step."""
    pipeline = session.opt_model.pipeline
    if pipeline is None or not mean:
        return {}
    from picofx.cost.model import CostModel

    predicted = pipeline.predict_stages(CostModel())
    return {"stages": sorted(predicted), "predicted_s": sum(predicted.values()),
            "measured_s": mean["forward"] + mean["backward"]}


def predicted_lines(args, layout, session, every: list[dict], predicted: dict) -> list[str]:
    """The planner's prediction of `layout` (the one that ran), component by component, beside rank 0's
    measured mean (the prediction's components also into `predicted`); and under --pp each stage's share
    of the measured and of the predicted time."""
    from picofx.cli.train_compare import compare_with_plan, stage_balance_lines

    return compare_with_plan(args, layout, session, every, predicted) + stage_balance_lines(every)
