"""picofx train --profile N --calibrate's communication: the link rates of the collectives the traced
steps ran (picofx.diagnose.collectives), each collective at its fastest over the ranks, per mesh
dimension. gloo's ranges do not name their process group: a run with one parallel dimension
attributes every collective to it; a run with several calibrates no link (its layout's dimensions
would be mixed)."""
from __future__ import annotations


def parallel_dimensions(layout) -> dict[str, int]:
    """The mesh dimensions of more than one rank of `layout` (the run's Layout), by name."""
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp}
    return {name: size for name, size in sizes.items() if size > 1}


def measured_link(layout, every: list[dict]) -> tuple[dict, str]:
    """({mesh dimension: link_rates' per kind}, what the summary says of it); `layout`: the Layout
    that ran (picofx.cli.train's ranks.layout, --layout auto's choice included)."""
    from picofx.diagnose.collectives import SMALL_BYTES, Collective, fastest_of_ranks, link_rates

    dims = parallel_dimensions(layout)
    if not dims:
        return {}, "one rank: no link to calibrate"
    if len(dims) > 1:
        return {}, (f"link not calibrated: the traced collectives of {' x '.join(dims)} are not told apart by "
                    "group (calibrate on a run of one parallel dimension)")
    (name, size), = dims.items()
    per_rank = [[Collective(**c) for c in figures.get("collectives", [])] for figures in every]
    rates = {kind: r for kind, r in link_rates(fastest_of_ranks(per_rank), size).items() if r["bandwidth"]}
    if not rates:
        return {}, f"link not calibrated: no collective of {SMALL_BYTES // 1024} KiB or more was traced on {name}"
    kind, rate = next(iter(rates.items()))
    return {name: rates}, (f"{name} link {rate['bandwidth'] / 1e9:.3g} GB/s, {rate['latency_s'] * 1e6:.0f} us per ring "
                           f"step (from {rate['large'] + rate['small']} traced {kind.replace('_', '-')}s)")
