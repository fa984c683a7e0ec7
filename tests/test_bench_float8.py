"""tools/bench_float8.py runs on the CPU: its numerics table, picofx's float8 against torchao's."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
pytest.importorskip("torchao.float8", reason="torchao is the float8 reference (the test extra)")
import bench_float8  # noqa: E402  (tools/bench_float8.py)


def test_numerics_table_puts_picofx_float8_nearer_torchao_than_bf16(tmp_path, capsys):
    out = tmp_path / "f8.json"
    bench_float8.main(["--recipes", "tensorwise", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "picofx float8" in printed and "torchao float8" in printed and f"wrote {out}" in printed
    rows = json.loads(out.read_text())["recipes"]["tensorwise"]
    assert rows["torchao float8"]["loss_vs_torchao"] == 0.0
    assert rows["picofx float8"]["loss_vs_torchao"] < 1e-4
    assert rows["picofx float8"]["grad_error_vs_torchao"] < rows["picofx bf16"]["grad_error_vs_torchao"]
