"""The planner's predictions against published figures (docs/PLANNER_ACCURACY.md) do not get worse."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

RECORDED = {  # |error| of docs/PLANNER_ACCURACY.md, per setup
    "Picotron Llama-2-7B, 64 H100": 0.52, "Picotron SmolLM-1.7B, 8 H100": 0.13,
    "torchtitan Llama 3.1 8B, 8 H100, FSDP + compile": 0.48, "torchtitan Llama 3 8B, 64 A100, FSDP2": 0.13,
    "torchtitan Llama 3 70B, 64 A100, FSDP2": 0.06,
}


@pytest.mark.slow
def test_no_published_setup_is_predicted_worse_than_recorded():
    path = Path(__file__).resolve().parents[2] / "tools" / "plan_published.py"
    import sys
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("plan_published", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rows = {r["setup"]: r for r in tool.rows()}
    assert rows.keys() == RECORDED.keys()
    for setup, error in RECORDED.items():
        assert abs(rows[setup]["error"]) <= error + 0.05, (setup, rows[setup]["error"])
        assert 0 < rows[setup]["predicted_mfu"] <= 1
