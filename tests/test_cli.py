import re
import subprocess
import sys
from pathlib import Path


from picofx.cli import main

FACTORY = '''
import torch
from torch import nn

def build():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    return model, (torch.randn(4, 8),), None
'''


def test_dump_prints_node_rows_and_the_pass_table(capsys, tmp_path):
    assert main(["dump", "llama-tiny", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header == ["name", "op", "target", "shape", "dtype", "flops", "bytes", "module"]
    q_proj = next(line for line in out.splitlines() if "aten.linear.default" in line)
    assert "2x32x64" in q_proj and "float32" in q_proj and "decoder_layers.0.attention.q_proj" in q_proj
    assert "parameter embedding.weight" in out
    assert "capture" in out and "compile (eager)" in out
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00_captured.txt", "01_joint.txt", "02_partitioned.forward.txt", "03_partitioned.backward.txt"]


def test_dump_loads_a_factory_from_a_file(capsys, tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(FACTORY)
    assert main(["dump", f"{path}:build", "--format", "dot"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("digraph G {") and "aten.gelu.default" in out


def test_dump_rejects_unknown_models_and_passes(capsys):
    assert main(["dump", "llama-huge"]) == 2
    assert re.search("unknown model 'llama-huge'.*llama-tiny", capsys.readouterr().err)
    assert main(["dump", "gpt2-tiny", "--passes", "nope"]) == 2
    assert "unknown pass 'nope'; available passes:" in capsys.readouterr().err


def test_console_script_is_installed(tmp_path):
    """The `picofx` command pip installed beside this interpreter, run as a user runs it."""
    command = Path(sys.executable).parent / "picofx"
    assert command.is_file(), f"{command} is missing: install the project (pip install -e .)"
    result = subprocess.run([str(command), "dump", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and "--passes" in result.stdout and "--format" in result.stdout
    (tmp_path / "my_model.py").write_text(FACTORY)
    result = subprocess.run([str(command), "dump", "my_model.py:build"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0].split() == ["name", "op", "target", "shape", "dtype", "flops", "bytes", "module"]
    assert "aten.gelu.default" in result.stdout and "compile (eager)" in result.stdout
