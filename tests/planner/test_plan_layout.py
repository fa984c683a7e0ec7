"""picofx plan --layout: one given layout predicted as the ranking predicts it, with the same JSON fields;
--gpu by profile name, --network by the cluster's, and --list-gpus."""
from __future__ import annotations

import json

import pytest

from picofx.cli import main
from picofx.cost.device import devices
from picofx.cost.gpus import NETWORKS
from picofx.planner import plan_run
from picofx.planner.layouts import Checkpointing, Layout
from picofx.planner.spec import parse_layout

TINY = ["plan", "llama-tiny", "--gpu", "h100", "--seq", "32", "--global-batch", "8"]


def test_a_spec_spells_the_plans_own_fields():
    assert parse_layout("dp=128,shard=true,tp=1,pp=1,microbatches=1,checkpoint=selective") == \
        Layout(128, 1, 1, shard=True, microbatches=1, checkpoint=Checkpointing.SELECTIVE)
    assert parse_layout("tp=2, sequence-parallel=yes", gpus=8) == Layout(4, 2, 1, sequence_parallel=True)
    assert parse_layout("dp=4,checkpoint=true,compress=bf16") == Layout(4, 1, 1, checkpoint="full", compress="bf16")
    assert parse_layout("dp=4,checkpoint=false,compress=none") == Layout(4, 1, 1)


@pytest.mark.parametrize("spec, error", [
    ("dp=4,stages=2", "unknown field 'stages'; the fields are dp, tp, pp, shard, microbatches, schedule, checkpoint"),
    ("dp=four", "dp='four': a whole number of at least 1"),
    ("dp=4,shard=maybe", "shard='maybe': true or false"),
    ("dp=4,checkpoint=some", "checkpoint 'some': one of none, selective, full"),
    ("dp=4,virtual_stages=0", "virtual_stages='0': a whole number of at least 1"),
    ("dp=4,schedule=ZeroBubble", "the planner predicts GPipe, 1F1B and Interleaved1F1B"),
    ("dp=4,compress=zip", "zip"),
    ("dp=4,dp=2", "dp given twice"),
    ("dp", "'dp' is not key=value"),
])
def test_a_wrong_spec_is_refused_naming_what_it_takes(spec, error):
    with pytest.raises(ValueError, match="--layout") as raised:
        parse_layout(spec)
    assert error in str(raised.value)


def test_the_layout_given_is_predicted_as_the_ranking_predicts_it(tmp_path, capsys):
    _, ranked = plan_run("llama-tiny", gpus=4, gpu="h100", seq=32, global_batch=8)
    wanted = next(p for p in ranked if p.layout == Layout(2, 2, 1, microbatches=2, checkpoint="selective"))
    out = tmp_path / "one.json"
    assert main([*TINY, "--layout", "dp=2,tp=2,microbatches=2,checkpoint=selective", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["plans"] == [json.loads(json.dumps(wanted.as_json()))] and data["best"] == 0
    assert "the layout given" in printed and "what to change:" in printed
    assert printed.count("  -> ") == 1 + len(wanted.suggestions)  # the row's best, then every suggestion


def test_a_layout_the_run_cannot_have_is_refused_before_it_is_predicted(capsys):
    assert main([*TINY, "--layout", "dp=3"]) == 2
    assert "the global batch 8 does not split into 3 x 1" in capsys.readouterr().err
    assert main([*TINY, "--gpus", "8", "--layout", "dp=2,tp=2"]) == 2
    assert "--layout 'dp=2,tp=2' is 4 GPUs (dp x tp x pp), --gpus 8" in capsys.readouterr().err
    assert main([*TINY, "--layout", "dp=4,stages=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the fields are dp, tp, pp" in err


def test_list_gpus_names_every_profile_and_network_and_their_sources(capsys):
    assert main(["plan", "--list-gpus"]) == 0
    printed = capsys.readouterr().out.splitlines()
    for name, device in devices().items():
        row = next(line for line in printed if line.split() and line.split()[0] == name)
        assert device.name in row and device.source in row and device.link_source in row
    for key, network in NETWORKS.items():
        row = next(line for line in printed if line.split() and line.split()[0] == key)
        assert network.name in row and network.source in row


def test_a_slower_network_between_nodes_exposes_a_sharded_runs_gathers(tmp_path, capsys):
    """The same sharded layout over 2 nodes: on a p4d's EFA (a quarter of HDR InfiniBand's bandwidth)
    its gathers take longer, and what the compute cannot hide is exposed."""
    steps = {}
    for network in ("ib-hdr", "efa-p4d"):
        out = tmp_path / f"{network}.json"
        assert main(["plan", "llama-tiny", "--gpu", "a100-80gb", "--network", network, "--seq", "32",
                     "--global-batch", "16", "--layout", "dp=16,shard=true", "--json", str(out)]) == 0
        steps[network] = json.loads(out.read_text())["plans"][0]["time"]["data_parallel_exposed"]
        assert f"(8 per node; {NETWORKS[network].name})" in capsys.readouterr().out
    assert steps["efa-p4d"] > steps["ib-hdr"] > 0


def test_an_unknown_network_or_one_the_gpu_cannot_have_is_refused_in_one_line(capsys):
    assert main([*TINY, "--gpus", "8", "--network", "nvl72"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--network 'nvl72': one of " in err and all(key in err for key in NETWORKS)
    assert main(["plan", "llama-tiny", "--gpu", "cpu", "--network", "efa-p4d", "--gpus", "2",
                 "--global-batch", "8"]) == 2
    assert "has no network between nodes to replace" in capsys.readouterr().err


def test_an_unknown_gpu_is_refused_naming_the_profiles(capsys):
    assert main(["plan", "llama-tiny", "--gpus", "4", "--gpu", "b300", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "--gpu 'b300': one of " in err and all(name in err for name in devices())
    assert main(["plan", "llama-tiny", "--gpus", "4"]) == 2
    assert "--global-batch is required" in capsys.readouterr().err
