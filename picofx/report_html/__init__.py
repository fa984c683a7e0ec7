"""One self-contained HTML page (inline SVG and CSS, nothing loaded) of what picofx did and predicts:
the passes, memory over the step, compute and communication per rank, the pipeline schedule, the
planner's plans, and a training run's loss. `Report.to_html`, `picofx dump|plan --html` and
`picofx train --report` write it."""
from __future__ import annotations

from torch import fx

from picofx.parallel.layouts import recorded
from picofx.report_html import data, sections
from picofx.report_html.measured import measured_section
from picofx.report_html.plans import plans_section
from picofx.report_html.page import page


def recorded_layouts(graphs: dict) -> tuple[list[tuple[str, str]], object]:
    """(title, text) of the bucket, shard and tensor-parallel layouts on the graphs, and the pipeline layout."""
    texts, pipeline = {}, None
    for role, gm in graphs.items():
        if not isinstance(gm, fx.GraphModule):
            continue
        found = recorded(gm)
        pipeline = pipeline or found.pipeline
        if found.buckets and found.buckets.entries:
            sizes = [sum(_numel(e.shape) for e in bucket) for bucket in found.buckets.buckets()]
            texts["gradient buckets (overlap)"] = "\n".join(
                f"bucket {i}: {len(b)} gradients, {n:,} elements, sent as {codec}" for i, (b, n, codec)
                in enumerate(zip(found.buckets.buckets(), sizes, found.buckets.codecs or ["none"] * len(sizes))))
        if found.shards and found.shards.entries:
            texts["sharded parameters (shard)"] = "\n".join(
                f"{e.name}: {list(e.shape)}, {e.padded_rows} rows per rank, gather bucket {e.bucket}"
                for e in found.shards.entries)
        if found.tensor_parallel and found.tensor_parallel.entries:
            texts["tensor-parallel split (tensor_parallel)"] = found.tensor_parallel.table()
        if found.pipeline:
            texts["pipeline cut (pipeline)"] = found.pipeline.table()
    return list(texts.items()), pipeline


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def render(report=None, *, graphs: dict | list | None = None, pipeline=None, plans: dict | None = None,
           losses: list[float] | dict | None = None, first_step: int = 1, measured_peak: int | None = None,
           world: int | None = None, cost_model=None, measured: dict | None = None, title: str = "picofx report",
           subtitle: str = "") -> str:
    """The page's HTML. `report`: a Report's to_dict() as Report.to_html gives it; `graphs`: the step's graphs
    ({"forward", "backward", ...}, or a list of pipeline stage graphs); `pipeline`: a PipelineLayout
    (found on the graphs where not given); `plans`: `picofx plan --json`'s dict (or its "plans" as planner
    Predictions); `losses`: per step from `first_step` (or {run name: per step}); `measured_peak`: bytes
    (else a pass's "measured_peak"); `world`: ranks the timeline predicts for (else the ranks the layouts were made
    for; one rank: the page says there is no communication); `measured`: a run's measured step per rank
    beside the predicted one (picofx.report_html.measured)."""
    graphs = dict(enumerate(graphs)) if isinstance(graphs, list) else dict(graphs or {})
    as_dict = report or {}
    layouts, found_pipeline = recorded_layouts(graphs)
    if as_dict.get("sections", {}).get("pipeline"):
        layouts = [(t, x) for t, x in layouts if t != "pipeline cut (pipeline)"]
    measured_peak = measured_peak or next((p["measured_peak"] for p in as_dict.get("passes", [])
                                           if isinstance(p.get("measured_peak"), int)), None)
    parts = [sections.passes_section(as_dict, layouts),
             sections.memory_section(data.memory_curve(graphs, cost_model), measured_peak),
             sections.timeline_section(data.comm_timeline(graphs, world, cost_model)),
             measured_section(measured),
             sections.pipeline_section(data.pipeline_schedule(pipeline or found_pipeline)),
             plans_section(plans),
             sections.loss_section(losses, first_step)]
    return page(title, subtitle, parts)


def write_html(path: str, report=None, **given) -> str:
    """Write render(report, **given) to `path`; returns the path."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(report, **given))
    return path
