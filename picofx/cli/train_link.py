"""picofx train --profile N --calibrate's communication: the link rates of the collectives the traced
steps ran (picofx.diagnose.collectives), each collective at its fastest over the ranks of its group,
per mesh dimension. A run with one parallel dimension attributes every collective to it. A run with
several names each collective's group by its gloo worker thread (picofx.diagnose.groups, a short
probe after the traced steps), fits each dimension's link apart where it traced enough collectives,
and maps each dimension to the link the planner prices it with (picofx.planner.layouts' Run.link: a
group within one node rides the node's link, one spanning nodes the network); the dimensions on one
level combine into its link (picofx.diagnose.collectives.combined).
"""
from __future__ import annotations

import dataclasses
import math
import os

LEVELS = {"node": "in-node", "network": "across nodes"}


def parallel_dimensions(layout) -> dict[str, int]:
    """The mesh dimensions of more than one rank of `layout` (the run's Layout), by name."""
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp}
    return {name: size for name, size in sizes.items() if size > 1}


def traced_collectives(args, collectives: list, opt_model) -> dict:
    """This rank's part of --profile's figures on its collectives: each as a dict and, with --calibrate
    on a CPU mesh of several dimensions, named by its group's dimension (a probe every rank runs),
    with the mesh's dimensions (outermost first) and sizes."""
    from picofx.diagnose.groups import named, worker_threads

    mesh = getattr(opt_model, "parallel_mesh", None)
    dims = mesh.used() if mesh is not None and args.calibrate and args.device == "cpu" else ()
    if len(dims) < 2:
        return {"collectives": [dataclasses.asdict(c) for c in collectives]}
    threads = worker_threads({name: mesh.dim(name).group for name in dims})
    return {"collectives": [dataclasses.asdict(c) for c in named(collectives, threads)],
            "mesh": {name: mesh.size(name) for name in dims}}


@dataclasses.dataclass(frozen=True)
class MeasuredLinks:
    """--calibrate's links: per mesh dimension (kept in the device profile for the reader), per level
    (what picofx.planner.device_profile.with_link writes into the device), and the summary's words."""

    dimensions: dict
    levels: dict
    said: str


def level_of(dim: str, sizes: dict[str, int], ranks_per_node: int) -> str:
    """"node" where a group of `dim` spans no more ranks than a node holds (its own size times the
    sizes of the dimensions inside it), else "network": the planner's rule (Run.link)."""
    names = list(sizes)
    spanned = math.prod(sizes[n] for n in names[names.index(dim):])
    return "node" if spanned <= ranks_per_node else "network"


def measured_link(args, layout, every: list[dict]) -> MeasuredLinks:
    """--calibrate's links from every rank's --profile figures (traced_collectives'); `layout`: the
    Layout that ran (picofx.cli.train's ranks.layout, --layout auto's choice included)."""
    ranks_per_node = min(int(os.environ.get("LOCAL_WORLD_SIZE", args.world)), args.world)
    per_rank, sizes = collectives_of(every), (every[0].get("mesh") if every else None)
    if sizes:  # named by group (HSDP's dp_replicate x dp_shard too, one "dp" to the layout)
        return per_dimension(sizes, per_rank, ranks_per_node)
    dims = parallel_dimensions(layout)
    if not dims:
        return MeasuredLinks({}, {}, "one rank: no link to calibrate")
    if len(dims) > 1:
        return MeasuredLinks({}, {}, f"link not calibrated: the traced collectives of {' x '.join(dims)} were not "
                                     "told apart by group (their gloo worker threads were not named)")
    (name, size), = dims.items()  # every collective is the dimension's: the world's group has its ranks
    per_rank = [[dataclasses.replace(c, group=name) for c in mine] for mine in per_rank]
    return per_dimension({name: size}, per_rank, ranks_per_node)


def collectives_of(every: list[dict]) -> list[list]:
    from picofx.diagnose.collectives import Collective

    return [[Collective(**c) for c in figures.get("collectives", [])] for figures in every]


def per_dimension(sizes: dict[str, int], per_rank: list[list], ranks_per_node: int) -> MeasuredLinks:
    """Each dimension's link from its own collectives; each level's from its dimensions' links (one
    node: its link is the network's too, the only link the ranks have)."""
    from picofx.diagnose.collectives import combined, link_rates
    from picofx.diagnose.groups import dimension_links, dimension_samples

    links = dimension_links(per_rank, sizes)
    dimensions, parts, fitted = {}, [], {"node": [], "network": []}
    for dim, link in links.items():
        level = level_of(dim, sizes, ranks_per_node)
        samples = [c for c, _ in dimension_samples(per_rank, sizes, dim)]
        dimensions[dim] = {"size": sizes[dim], "level": level, "link": link, "kinds": link_rates(samples, sizes[dim])}
        if link["bandwidth"]:
            fitted[level].append(dim)
            parts.append(f"{dim} {rates(link)}")
        else:
            parts.append(f"{dim} not fitted: {too_few(link)}")
    levels = {level: {**combined([links[d] for d in dims]), "dims": dims} for level, dims in fitted.items() if dims}
    if "node" in levels and math.prod(sizes.values()) <= ranks_per_node:
        levels["network"] = levels["node"]
    said = [f"{LEVELS[level]} link from {' and '.join(link['dims'])}: {rates(link)}" for level, link in levels.items()
            if level == "node" or link is not levels.get("node")]
    unmeasured = [LEVELS[level] for level in LEVELS if level not in levels]
    said += [f"{' and '.join(unmeasured)} link not calibrated (no dimension fitted there)"] if unmeasured else []
    if len(sizes) == 1:
        (dim, link), = links.items()
        return MeasuredLinks(dimensions, levels, f"{dim} link {rates(link)}" if link["bandwidth"] else
                             f"link not calibrated on {dim}: {too_few(link)}")
    return MeasuredLinks(dimensions, levels, "links per mesh dimension: " + "; ".join(parts + said))


def rates(link: dict) -> str:
    kinds = " and ".join(k.replace("_", "-") + "s" for k in link["kinds"])
    return (f"{link['bandwidth'] / 1e9:.3g} GB/s, {link['latency_s'] * 1e6:.0f} us per ring step "
            f"(from {link['large'] + link['small']} traced {kinds})")


def too_few(link: dict) -> str:
    from picofx.diagnose.collectives import MIN_LARGE, SMALL_BYTES

    return (f"{link['large']} ring collective{'s' if link['large'] != 1 else ''} of {SMALL_BYTES // 1024} KiB or "
            f"more, at least {MIN_LARGE} needed")
