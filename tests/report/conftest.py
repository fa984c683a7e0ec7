"""The kinds of HTML page, each written once per test session: an optimize run's report (overlap,
predicted for 8 ranks), `picofx plan --html`, `picofx dump --html` (pipeline; overlap on one process)
and `picofx train --report`."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from picofx import optimize
from picofx.cli import main as picofx_main
from picofx.models import zoo
from picofx.parallel.mesh import one_process_group
from picofx.passes import Checkpoint, Overlap


@pytest.fixture(scope="session")
def optimize_page(tmp_path_factory):
    """Checkpoint and overlap on one gloo rank; the timeline predicted for 8 ranks."""
    made = not dist.is_initialized()
    one_process_group()
    built = zoo.build("llama-tiny")
    opt = optimize(built.model, built.example_inputs, passes=[Checkpoint(), Overlap()], backend="eager",
                   loss_fn=built.loss_fn)
    path = opt.report.to_html(str(tmp_path_factory.mktemp("html") / "optimize.html"), world=8,
                              title="optimize <tiny> & overlap")
    if made:
        dist.destroy_process_group()
    return path


@pytest.fixture(scope="session")
def plan_page(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("html") / "plan.html")
    assert picofx_main(["plan", "llama-tiny", "--gpus", "4", "--gpu", "cpu", "--seq", "128", "--global-batch", "8",
                        "--top", "6", "--html", path]) == 0
    return path


@pytest.fixture(scope="session")
def dump_page(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("html") / "dump.html")
    assert picofx_main(["dump", "llama-tiny", "--passes", "pipeline", "--batch", "4", "--pipeline.stages", "2",
                        "--pipeline.microbatches", "4", "--html", path]) == 0
    return path


@pytest.fixture(scope="session")
def overlap_dump_page(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("html") / "overlap_dump.html")
    assert picofx_main(["dump", "llama-tiny", "--passes", "overlap", "--html", path]) == 0
    return path


@pytest.fixture(scope="session")
def train_page(tmp_path_factory):
    from picofx.cli import train as train_llama

    path = str(tmp_path_factory.mktemp("html") / "train.html")
    result = train_llama.main(["--backend", "eager", "--steps", "4", "--batch", "2", "--seq", "32", "--log-every",
                               "2", "--passes", "fuse", "checkpoint", "--report", path])
    return path, result["losses"]
