"""The byte model at the real shapes (issue 47): on fake tensors, one layer at the real width, each
fused pattern moves no more bytes than the unfused ops it replaces, and the fused step no more
than the unfused one, counted the same way under picofx's model of Inductor's fusion."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from picofx.planner.pattern_bytes import OTHER, SHAPES, hf_llama, rows, step_traffic  # noqa: E402

COUNT = "import json, sys; from picofx.planner.pattern_bytes import pattern_bytes; " \
        "print(json.dumps(pattern_bytes(sys.argv[1], gpu='h200', counted_layers=(1,))))"


@pytest.fixture(scope="module", params=sorted(SHAPES))
def counted(request):
    # One process per shape: two shapes' fake-tensor captures in one pytest process crashed its
    # garbage collector (torch 2.13), which a plain script counting both does not.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", COUNT, request.param], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def _worse(counted) -> dict[str, str]:
    return {r["pattern"]: f"{r['pattern']}: {_gb(r['fused_bytes'])} fused against {_gb(r['unfused_bytes'])} unfused "
                          f"(+{_gb(r['fused_bytes'] - r['unfused_bytes'])})"
            for r in rows(counted) if r["pattern"] not in ("step", OTHER) and r["fused_bytes"] > r["unfused_bytes"]}


def test_no_fused_pattern_moves_more_bytes_than_the_ops_it_replaces(counted):
    worse = _worse(counted)
    assert not worse, f"{counted['shape']}: " + "; ".join(worse.values())


def test_the_fused_step_moves_no_more_bytes_than_the_unfused_step(counted):
    step = rows(counted)[-1]
    assert step["fused_bytes"] <= step["unfused_bytes"], (
        f"{counted['shape']}: the fused step moves {_gb(step['fused_bytes'])}, the unfused {_gb(step['unfused_bytes'])}")


def test_every_rule_that_fires_has_its_unfused_counterpart(counted):
    fired = {name for name, t in counted["fused"].items() if name != OTHER and t["read"] + t["written"]}
    assert {"rms_norm", "add_rms_norm", "linear_cross_entropy", "swiglu", "rope", "grouped_query_attention"} <= fired
    assert all(counted["unfused"].get(name, {}).get("read") for name in fired), fired


def test_an_unknown_device_is_refused_by_name():
    model, inputs = hf_llama("llama-3.2-1b", 1)
    with pytest.raises(ValueError, match="unknown device 'h300'"):
        step_traffic(model, inputs, True, gpu="h300")
