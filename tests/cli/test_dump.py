import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from picofx.cli import main
from picofx.manager import PASSES

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


def test_dump_of_a_communicating_pass_on_one_process_prints_nothing_on_stderr(tmp_path):
    """overlap's all-reduces run on a one-rank group; the report's memory prediction must not run
    one of them for real (torch then warns at exit of a collective never waited for)."""
    result = subprocess.run([sys.executable, "-m", "picofx", "dump", "llama-tiny", "--passes", "overlap",
                             "--html", str(tmp_path / "report.html")], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    assert "all_reduce" in result.stdout and (tmp_path / "report.html").is_file()


def test_version_comes_from_the_installed_package(capsys):
    import importlib.metadata

    import picofx

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    installed = importlib.metadata.version("picofx")
    assert picofx.__version__ == installed and capsys.readouterr().out.startswith(f"picofx {installed} ")


def test_help_lists_every_option_of_every_pass_from_its_fields(capsys):
    with pytest.raises(SystemExit):
        main(["dump", "--help"])
    out = capsys.readouterr().out
    for name, factory in PASSES.items():
        for field in dataclasses.fields(factory) if dataclasses.is_dataclass(factory) else ():
            flag = f"--{name}.{field.name}"
            if not field.init:  # the pass's own state (overlap's per-model states), not an option
                assert flag not in out and f"{field.name}=" not in out, flag
                continue
            assert flag in out or re.search(rf"only Python can give: .*{field.name}", out), flag
    assert "--pipeline.microbatches int" in out and "--batch" in out and "--seq" in out
    assert "WeakKeyDictionary" not in out


@pytest.mark.parametrize("argv, message", [
    (["--passes", "pipeline", "--pipeline.microbatches", "many"], "pipeline.microbatches takes an integer, not 'many'"),
    (["--pipeline.stages", "3"], "--pipeline.stages is an option of the pipeline pass: add pipeline to --passes"),
    (["--passes", "pipeline", "--pipeline.schedule", "Foo"], "unknown schedule 'Foo'"),
    (["--passes", "pipeline", "--pipeline.microbatchs", "2"], "unrecognized arguments: --pipeline.microbatchs"),
    (["--passes", "pipeline"], "4 micro-batches do not divide the batch of 2.*--batch"),
    (["--batch", "0"], "argument --batch: a whole number of at least 1, not '0'"),
])
def test_wrong_pass_options_are_usage_errors(capsys, argv, message):
    code = None
    try:
        code = main(["dump", "llama-tiny", *argv])
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    assert code == 2 and re.search(message, capsys.readouterr().err)


def test_pipeline_stages_are_planned_on_one_process(capsys):
    assert main(["dump", "llama-tiny", "--passes", "pipeline", "checkpoint", "--batch", "6", "--seq", "16",
                 "--pipeline.stages", "3", "--pipeline.microbatches", "3", "--pipeline.schedule", "GPipe"]) == 0
    out = capsys.readouterr().out
    stages = re.findall(r"^stage (\d) of (\d):$", out, re.MULTILINE)
    assert stages == [("0", "3"), ("1", "3"), ("2", "3")]
    first_stage = out[out.index("stage 0 of 3:"):out.index("stage 1 of 3:")]
    assert "2x16x64" in first_stage  # one micro-batch of 6 / 3 rows, 16 positions
    assert "GPipe, 3 stages (1 per rank), 3 micro-batches" in out
    assert "Checkpoint run on each stage's graph on its rank under torchrun" in out


def test_a_factory_takes_batch_and_seq_or_the_flags_are_refused(capsys, tmp_path):
    path = tmp_path / "sized.py"
    path.write_text(FACTORY + "\n\ndef sized(batch=4, seq=8):\n"
                    "    return nn.Linear(seq, 1), (torch.randn(batch, seq),), None\n")
    assert main(["dump", f"{path}:sized", "--batch", "3", "--seq", "5"]) == 0
    assert "3x5" in capsys.readouterr().out
    assert main(["dump", f"{path}:build", "--batch", "3"]) == 2
    assert "--batch: build() in" in capsys.readouterr().err


def test_checkpoint_says_why_it_recomputed_nothing(capsys):
    assert main(["dump", "llama-tiny", "--passes", "checkpoint", "--wide"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"nothing_recomputed=the no-checkpoint peak [0-9.]+ MiB is already under the budget "
                     r"16\.00 GiB; lower the budget", out)
    assert main(["dump", "llama-tiny", "--passes", "checkpoint", "--checkpoint.budget", "0.8", "--wide"]) == 0
    assert "nothing_recomputed" not in capsys.readouterr().out


def test_option_text_becomes_the_fields_type():
    from picofx.manager.options import pass_options

    def option(pass_name, name):
        return next(o for o in pass_options(pass_name) if o.name == name)

    budget = option("checkpoint", "budget")
    assert [budget.parse(t) for t in ("8GiB", "0.8", "1000", "none")] == ["8GiB", 0.8, 1000, None]
    assert option("fuse", "rules").parse("rms_norm, swiglu") == ("rms_norm", "swiglu")
    balance = option("pipeline", "balance")
    assert balance.parse("layers") == "layers" and balance.parse("layers.1,layers.2") == ("layers.1", "layers.2")
    assert option("precision", "overrides").parse("lm_head=fp32,*.mlp.*=bf16") == {"lm_head": "fp32", "*.mlp.*": "bf16"}
    assert option("fuse", "explain").parse("yes") is True and option("fuse", "explain").parse("off") is False
    with pytest.raises(ValueError, match="pipeline.microbatches takes an integer, not '2.5'"):
        option("pipeline", "microbatches").parse("2.5")
    assert not option("pipeline", "group").from_text and not option("checkpoint", "optimizer").from_text
