"""Plans several planner tests read: each costs a minute of capture, so it is made once per session."""
from __future__ import annotations

import pytest

from picofx.planner import plan_run


@pytest.fixture(scope="session")
def llama2_7b_on_8_h100():
    return plan_run("llama2-7b", gpus=8, gpu="h100", seq=4096, global_batch=256)


@pytest.fixture(scope="session")
def llama2_70b_on_64_h100():
    return plan_run("llama2-70b", gpus=64, gpu="h100", seq=4096, global_batch=512)
