"""Tools write where the user says or into a fresh directory, and print picofx's output only."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from results import result_path, write_json  # noqa: E402  (tools/results.py)


def test_results_go_where_the_user_says_or_to_a_fresh_printed_directory(tmp_path, monkeypatch, capsys):
    given = tmp_path / "new" / "folder" / "out.json"
    assert write_json({"a": 1}, str(given), "bench.json") == given and given.read_text().strip().endswith("}")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first, second = result_path(None, "bench.json"), write_json([1], None, "bench.json")
    assert first.parent != second.parent and first.parent.parent == second.parent.parent == tmp_path
    assert second.name == "bench.json" and second.is_file()
    assert capsys.readouterr().out.splitlines() == [f"wrote {given}", f"wrote {second}"]


def json_arguments(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in ("--json", "--out"):
            yield node


@pytest.mark.parametrize("tool", sorted(p.name for p in (ROOT / "tools").glob("*.py")))
def test_no_tool_writes_to_a_fixed_path(tool):
    tree = ast.parse((ROOT / "tools" / tool).read_text())
    for argument in json_arguments(tree):
        defaults = [k.value for k in argument.keywords if k.arg == "default"]
        assert not defaults, f"{tool}: --json has a fixed default {ast.unparse(defaults[0])}; use results.write_json"
    fixed = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "open"
             and n.args and isinstance(n.args[0], ast.Constant)
             and any(isinstance(a, ast.Constant) and "w" in str(a.value) for a in n.args[1:])]
    assert not fixed, f"{tool} writes to a fixed path: {ast.unparse(fixed[0])}"


RANKS = textwrap.dedent('''
    import sys
    sys.path[:0] = [{tools!r}, {harness!r}]
    from quiet_ranks import quiet_rank
    from spawn_ranks import run_ranks

    def step(rank, world):
        quiet_rank()
        import torch
        from torch.nn.parallel import DistributedDataParallel
        torch.compile(lambda x: (x.sin() + 1).sum())(torch.randn(8))  # a kernel, awaited under a progress bar
        model = torch.compile(DistributedDataParallel(torch.nn.Linear(4, 4)))
        model(torch.randn(2, 4)).sum().backward()
        return rank

    if __name__ == "__main__":
        print(run_ranks(step, 2, timeout=400))
''')


@pytest.mark.slow
def test_compiling_ranks_print_no_profiler_line_and_leak_no_semaphore(tmp_path):
    """The causes behind bench_overlap's stray lines: Dynamo tracing DDP's record_function, and
    Inductor's progress-bar lock in a rank that ends with os._exit."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS.format(tools=str(ROOT / "tools"), harness=str(ROOT / "tests" / "passes")))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # compiled, not read from a cache
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=500, cwd=tmp_path,
                            env=env)
    assert result.returncode == 0 and result.stdout.strip() == "[0, 1]", result.stderr[-3000:]
    assert "Profiler record function" not in result.stderr, result.stderr[-3000:]
    assert "leaked semaphore" not in result.stderr, result.stderr[-3000:]
