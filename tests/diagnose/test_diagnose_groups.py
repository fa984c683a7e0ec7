"""--calibrate on a mesh of several dimensions, on synthetic traces: each collective named by its gloo
worker thread's group, each dimension's link fitted from its own collectives at their fastest rank,
the dimensions mapped to the in-node link or the network as the planner prices them, and the device
profile's links set from them."""
import pytest

from picofx.cli.train_link import measured_link
from picofx.cost.device import device_for
from picofx.diagnose.collectives import Collective
from picofx.diagnose.groups import groups_of, named, threads_of
from picofx.planner.device_profile import with_link
from picofx.planner.layouts import Layout

KIB, MIB = 2**10, 2**20
TP = {"bandwidth": 1e9, "latency": 1e-3}  # tp's ring: 1 GB/s, 1 ms a step
DP = {"bandwidth": 0.25e9, "latency": 3e-3}  # dp_shard's: slower, as a link across nodes would be
THREADS = {"tp": 11, "dp_shard": 21, None: 31}  # each group's worker thread (None: the world group's)


def collective(kind: str, nbytes: int, ranks: int, link: dict, late: float, group) -> dict:
    """A ring collective's seconds on `link` (picofx.cost.comm's ring; an all-gather's input is one
    piece), `late` times longer on a rank that arrived early and waited."""
    steps = 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1
    wire = 2 * (ranks - 1) / ranks * nbytes if kind == "all_reduce" else (ranks - 1) * nbytes
    seconds = steps * link["latency"] + (wire / link["bandwidth"] if nbytes >= 64 * KIB else 0.0)
    return {"kind": kind, "nbytes": nbytes, "seconds": seconds * (1 + late), "thread": THREADS[group], "group": None}


def rank_figures(rank: int, dp_large: int = 3) -> dict:
    """Rank `rank` of dp_shard 2 x tp 2: tp's all-reduces (activations), dp_shard's all-gathers
    (parameters), a world all-reduce (the gradient norm) far slower than either."""
    tp_late, dp_late = 0.5 * (rank % 2), 0.5 * (rank // 2)  # the other rank of each group waited
    made = [collective("all_reduce", 1 * KIB, 2, TP, tp_late, "tp") for _ in range(2)]
    made += [collective("all_reduce", 1 * MIB, 2, TP, tp_late, "tp") for _ in range(4)]
    made += [collective("all_gather", 2 * KIB, 2, DP, dp_late, "dp_shard") for _ in range(2)]
    made += [collective("all_gather", 512 * KIB, 2, DP, dp_late, "dp_shard") for _ in range(dp_large)]
    made += [collective("all_reduce", 4 * MIB, 4, {"bandwidth": 1e6, "latency": 0.1}, 0.0, None)]
    return {"collectives": made}


def named_figures(dp_large: int = 3) -> list[dict]:
    threads = {thread: group for group, thread in THREADS.items() if group}
    every = []
    for rank in range(4):
        mine = [Collective(**c) for c in rank_figures(rank, dp_large)["collectives"]]
        every.append({"collectives": [c.__dict__ for c in named(mine, threads)], "mesh": {"dp_shard": 2, "tp": 2}})
    return every


def mesh_args():
    from picofx.cli.train_args import parse_args

    return parse_args(["--tp", "2", "--shard"], environ={"RANK": "0", "WORLD_SIZE": "4"})


def test_each_dimension_gets_its_own_link_and_one_node_shares_them(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # every rank in one node
    links = measured_link(mesh_args(), Layout(dp=2, tp=2), named_figures())
    tp, dp = links.dimensions["tp"]["link"], links.dimensions["dp_shard"]["link"]
    assert tp["bandwidth"] == pytest.approx(TP["bandwidth"]) and tp["latency_s"] == pytest.approx(TP["latency"])
    # an all-gather's traced input is one rank's piece: (n-1) x it crosses the link
    assert dp["bandwidth"] == pytest.approx(DP["bandwidth"]) and dp["latency_s"] == pytest.approx(DP["latency"])
    assert (tp["large"], tp["small"], dp["large"], dp["small"]) == (8, 4, 6, 4)  # both groups of each dimension
    node = links.levels["node"]
    assert node["dims"] == ["dp_shard", "tp"] and links.levels["network"] is node
    # the bandwidth that moves both dimensions' large collectives in the time their own links take
    tp_wire, dp_wire = 8 * MIB, 6 * 512 * KIB
    both = (tp_wire + dp_wire) / (tp_wire / TP["bandwidth"] + dp_wire / DP["bandwidth"])
    assert node["bandwidth"] == pytest.approx(both)
    # and the latency that gives their ring steps (tp: 12 x 2, dp_shard: 10 x 1) the time theirs do
    assert node["latency_s"] == pytest.approx((24 * TP["latency"] + 10 * DP["latency"]) / 34)
    assert "tp 1 GB/s, 1000 us per ring step (from 12 traced all-reduces)" in links.said
    assert "dp_shard 0.25 GB/s, 3000 us per ring step (from 10 traced all-gathers)" in links.said
    assert "in-node link from dp_shard and tp" in links.said


def test_a_dimension_across_nodes_prices_the_network_and_the_device_carries_both(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # tp 2 inside a node, dp_shard across the two
    links = measured_link(mesh_args(), Layout(dp=2, tp=2), named_figures())
    assert links.dimensions["tp"]["level"] == "node" and links.dimensions["dp_shard"]["level"] == "network"
    device = with_link(device_for("cpu"), links.levels, "a test")
    assert device.intra_node_link.bandwidth == pytest.approx(TP["bandwidth"])
    assert device.intra_node_link.latency == pytest.approx(TP["latency"])
    assert device.inter_node_link.bandwidth == pytest.approx(DP["bandwidth"])
    assert device.inter_node_link.latency == pytest.approx(DP["latency"])
    assert "tp" in device.link_name and "dp_shard" in device.network_name


def test_a_dimension_with_too_few_collectives_is_named_and_not_fitted(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    links = measured_link(mesh_args(), Layout(dp=2, tp=2), named_figures(dp_large=0))  # dp_shard's all-gathers all small
    assert links.dimensions["dp_shard"]["link"]["bandwidth"] is None
    assert "dp_shard not fitted: 0 ring collectives of 64 KiB or more, at least 2 needed" in links.said
    assert "across nodes link not calibrated" in links.said and set(links.levels) == {"node"}
    nominal = device_for("cpu")
    device = with_link(nominal, links.levels, "a test")
    assert device.network_bandwidth == nominal.network_bandwidth  # what was not measured keeps its figure


def test_collectives_not_told_apart_by_group_calibrate_no_link():
    unnamed = [{"collectives": rank_figures(rank)["collectives"]} for rank in range(4)]
    links = measured_link(mesh_args(), Layout(dp=2, tp=2), unnamed)
    assert links.levels == {} and "not told apart by group" in links.said


def test_the_probe_names_the_threads_whose_ranges_start_in_a_dimensions_range():
    events = [{"ph": "X", "name": "picofx.group:tp", "ts": 0, "dur": 100, "tid": 1},
              {"ph": "X", "name": "picofx.group:dp_shard", "ts": 200, "dur": 100, "tid": 1},
              {"ph": "X", "name": "gloo:all_reduce", "ts": 10, "dur": 5, "tid": 11},
              {"ph": "X", "name": "gloo:all_reduce", "ts": 20, "dur": 5, "tid": 12},
              {"ph": "X", "name": "gloo:all_reduce", "ts": 210, "dur": 5, "tid": 21},
              {"ph": "X", "name": "gloo:all_reduce", "ts": 150, "dur": 5, "tid": 31}]  # in neither
    assert threads_of(events) == {11: "tp", 12: "tp", 21: "dp_shard"}


def test_groups_of_a_mesh_are_laid_out_as_device_mesh_lays_them():
    sizes = {"pp": 2, "dp_shard": 2, "tp": 2}
    assert groups_of(sizes, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups_of(sizes, "dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups_of(sizes, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_hsdp_fits_its_two_data_parallel_dimensions_apart(monkeypatch):
    """--shard --dp-replicate 2: one "dp" of 4 to the layout, two groups of 2 on the mesh."""
    from picofx.cli.train_args import parse_args

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    renamed = {"tp": "dp_shard", "dp_shard": "dp_replicate"}
    every = [{"collectives": [{**c, "group": renamed.get(c["group"])} for c in figures["collectives"]],
              "mesh": {"dp_replicate": 2, "dp_shard": 2}} for figures in named_figures()]
    args = parse_args(["--shard", "--dp-replicate", "2"], environ={"RANK": "0", "WORLD_SIZE": "4"})
    links = measured_link(args, Layout(dp=4), every)
    assert links.dimensions["dp_shard"]["size"] == 2 and links.dimensions["dp_replicate"]["size"] == 2
    assert links.dimensions["dp_shard"]["link"]["bandwidth"] == pytest.approx(TP["bandwidth"])
    assert links.dimensions["dp_replicate"]["link"]["bandwidth"] == pytest.approx(DP["bandwidth"])
