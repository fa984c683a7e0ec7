"""--profile's comparisons, as pure functions: the planner's time terms against the measured components,
the pipeline stages' measured balance against the cut's, the device profile --calibrate stores and
reads back, and the --report section of the measured step per rank."""

import pytest
import torch

from picofx.cli.train_compare import components, measured_components, stage_balance_lines
from picofx.cost.device import device_for
from picofx.planner.device_profile import read_device_profile, scaled, write_device_profile
from picofx.planner.layouts import Layout
from picofx.report_html import render


def test_the_planner_terms_meet_the_measured_components():
    prediction = type("P", (), {"step_s": 1.0, "time": {"compute": 0.5, "recompute": 0.1, "optimizer": 0.2,
                                                         "bubble": 0.1, "data_parallel_exposed": 0.1}})()
    assert components(prediction) == pytest.approx({"compute": 0.6, "optimizer": 0.2, "exposed_comm": 0.2, "step": 1.0})
    mean = {"seconds": 2.0, "data": 0.2, "checkpoint": 0.1, "forward": 0.5, "backward": 0.7, "optimizer": 0.3,
            "exposed_comm": 0.1}
    assert measured_components(mean) == pytest.approx({"compute": 1.2, "optimizer": 0.3, "exposed_comm": 0.1,
                                                        "step": 1.7})


def test_stage_balance_names_each_stage_share_measured_and_predicted():
    every = [{"stages": {"stages": [0], "predicted_s": 1.0, "measured_s": 3.0}},
             {"stages": {"stages": [1], "predicted_s": 1.0, "measured_s": 1.0}}]
    (line,) = stage_balance_lines(every)
    assert "measured shares of forward + backward 75%/25%, the cut predicted 50%/50%" in line
    assert "slowest stage 50% above the mean (predicted 0%)" in line
    assert stage_balance_lines([{"stages": {}}, {"stages": {}}]) == []  # no pipeline: nothing said


def test_a_calibrated_device_is_stored_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path))
    assert read_device_profile(2) is None
    nominal = device_for("cpu")
    calibrated = scaled(nominal, 4.0, 2e-5)
    assert calibrated.peak_flops[torch.float32] == nominal.peak_flops[torch.float32] / 4
    assert calibrated.op_overhead == nominal.op_overhead * 4 and calibrated.optimizer_tensor_overhead == 2e-5
    path = write_device_profile(calibrated, 2, "a test")
    device, how = read_device_profile(2)
    assert device == calibrated and str(path) in how and "a test" in how
    assert read_device_profile(4) is None  # another number of ranks: not this one's
    path.write_text("{")
    assert read_device_profile(2) is None  # unreadable: measured again


def test_the_report_draws_each_rank_measured_beside_the_predicted():
    mean = {"seconds": 0.01, "data": 0.001, "forward": 0.003, "backward": 0.004, "optimizer": 0.001,
            "checkpoint": 0.0, "exposed_comm": 0.0005, "idle": 0.0002, "unattributed": 0.0003, "hidden_comm": 0.002}
    html = render(measured={"ranks": [mean, mean],
                            "predicted": {"compute": 0.002, "optimizer": 0.0005, "exposed_comm": 0.0, "step": 0.0025}})
    assert "Measured step per rank" in html and "rank 1 measured" in html and ">predicted<" in html
    assert "The planner predicted a step of 2.5 ms" in html
    assert "Measured step per rank" not in render()


def link_args(*argv: str):
    from picofx.cli.train_args import parse_args

    return parse_args(list(argv), environ={"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})


def test_calibrate_fits_the_link_from_each_collective_at_its_fastest_rank():
    from picofx.cli.train_link import measured_link

    mib = 4 * 2**20

    def rank(small_s, large_s):
        return {"collectives": [{"kind": "all_reduce", "nbytes": 4, "seconds": small_s},
                                *[{"kind": "all_reduce", "nbytes": mib, "seconds": large_s}] * 3,
                                {"kind": "gather", "nbytes": 12, "seconds": 0.5}]}  # not a ring: not fitted
    # 4 ranks on dp: 6 ring steps; the rank that arrived last times each collective alone
    links = measured_link(link_args("--dp", "4"), Layout(dp=4), [rank(0.003, 0.5), rank(0.006, 0.2), rank(0.009, 0.3),
                                                                  rank(0.012, 0.4)])
    fitted = links.dimensions["dp"]["link"]
    assert fitted["latency_s"] == pytest.approx(0.003 / 6)
    assert fitted["bandwidth"] == pytest.approx(6 / 4 * mib / (0.2 - 0.003))
    assert links.dimensions["dp"]["kinds"]["all_reduce"]["bandwidth"] == pytest.approx(fitted["bandwidth"])
    assert links.said.startswith("dp link ") and "from 4 traced all-reduces" in links.said
    device = with_link(device_for("cpu"), links.levels, "a test")
    assert device.link_bandwidth == fitted["bandwidth"] and device.link_latency == fitted["latency_s"]
    assert device.network_bandwidth == fitted["bandwidth"]  # one machine: gloo's loopback is its only link
    one_large = [{"collectives": rank(0.003, 0.2)["collectives"][:2]}] * 4
    links = measured_link(link_args("--dp", "4"), Layout(dp=4), one_large)
    assert links.levels == {} and links.said == ("link not calibrated on dp: 1 ring collective of 64 KiB or more, "
                                                 "at least 2 needed")
    links = measured_link(link_args("--dp", "2", "--tp", "2"), Layout(dp=2, tp=2), [rank(0.003, 0.2)] * 4)
    assert links.levels == {} and "link not calibrated" in links.said and "dp x tp" in links.said
    # the layout the run ran (--layout auto's choice on 4 ranks), not one rebuilt from options that name none
    links = measured_link(link_args(), Layout(tp=4), [rank(0.003, 0.2)] * 4)
    assert list(links.dimensions) == ["tp"] and links.said.startswith("tp link "), links.said


def with_link(device, levels, how):
    from picofx.planner.device_profile import with_link

    return with_link(device, levels, how)
