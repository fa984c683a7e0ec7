"""A new user's path: errors they can catch and read, options checked before the slow capture,
a quiet terminal, a report that fits, the training script and the dump command.
(That `import picofx` alone gives picofx.passes is tested in test_architecture.py.)"""
import dataclasses
import json
import logging
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

import picofx
from picofx.cli import main as cli_main
from picofx.models import zoo
from picofx.manager import PassRecord, Stage
from picofx.manager.report import WIDTH, Report
from picofx.rewrite.matcher import NearMiss

ROOT = Path(__file__).resolve().parents[1]


class Untraceable(nn.Module):
    """Fails the moment anyone captures it: an error about options must come before that."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        raise AssertionError("the model was run before the options were checked")


def two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


# ---- 2. errors: caught by the type the README names -------------------------------------------

def test_an_unreachable_budget_is_caught_as_budget_error_and_names_the_pass():
    z = zoo.build("llama-tiny")
    with pytest.raises(picofx.BudgetError) as info:
        picofx.optimize(z.model, z.example_inputs, [picofx.passes.Checkpoint(budget=1000)],
                        backend="eager", loss_fn=z.loss_fn)
    error = info.value
    assert isinstance(error, picofx.PassError) and error.smallest_peak > 1000
    assert re.search(r"pass 'checkpoint' .*smallest peak .*left as it was before 'checkpoint'", str(error), re.S)


def test_every_error_the_readme_names_is_exported_where_it_says():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`(picofx(?:\.\w+)*\.\w+Error)`", readme))
    assert {"picofx.BudgetError", "picofx.CaptureError", "picofx.InputShapeError"} <= named
    for dotted in named:
        module, _, name = dotted.rpartition(".")
        assert getattr(__import__(module, fromlist=[name]), name) is getattr(picofx.errors, name), dotted
        assert getattr(picofx, name) is getattr(picofx.errors, name)


# ---- 3. options are checked when the pass is built, before the capture ------------------------

@pytest.mark.parametrize("budget, message", [
    ("abc", r"cannot read budget 'abc': write bytes with a unit, e\.g\. '8GiB'"),
    ("8G", r"'8G' is ambiguous: write '8GiB' .* or '8GB'"),
    ("0.5", r"'0\.5' has no unit.*a fraction of the peak is a float \(budget=0\.5\)"),
    ("-1GiB", "a budget is a positive amount of memory, got '-1GiB'"),
    (-5, "a budget is a positive amount of memory, got -5"),
    (-0.5, "a budget is a positive amount of memory"),
    (8e9, r"8000000000\.0 is a float, which means a fraction .* pass an int \(8_000_000_000\)"),
])
def test_bad_budgets_fail_when_the_pass_is_built(budget, message):
    with pytest.raises(ValueError, match=message):
        picofx.passes.Checkpoint(budget=budget)


@pytest.mark.parametrize("budget", ["8GiB", "8GB", "512 MiB", "1e9", 0.5, 2**30])
def test_good_budgets_are_accepted(budget):
    assert picofx.passes.Checkpoint(budget=budget).budget == budget


@pytest.mark.parametrize("passes, error, message", [
    ("fuse", TypeError, r"passes is a list: passes=\['fuse'\], not passes='fuse'"),
    ([picofx.passes.Fuse], TypeError, r"got the class Fuse: did you mean Fuse\(\)\?"),
    (["fsue"], KeyError, "unknown pass 'fsue'; available passes: .*; did you mean 'fuse'\\?"),
])
def test_pass_mistakes_are_reported_before_the_capture(passes, error, message):
    with pytest.raises(error, match=message):
        picofx.optimize(Untraceable(), (torch.randn(2, 4),), passes, backend="eager")


# ---- 4. errors in the user's terms --------------------------------------------------------------

def test_a_sequence_longer_than_the_model_allows_names_the_length_and_the_limit():
    z = zoo.build("llama-tiny", seq=200)  # max_position_embeddings is 128
    with pytest.raises(picofx.CaptureError) as info:
        picofx.optimize(z.model, z.example_inputs, backend="eager", loss_fn=z.loss_fn)
    assert re.search(r"input_ids has 200 positions .* max_position_embeddings=128", str(info.value))
    assert "at most 128 tokens" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no torch traceback under it


def test_use_cache_says_to_pass_use_cache_false_in_a_few_lines():
    z = zoo.build("hf-llama-tiny")  # the config's use_cache picofx turns off for the capture; the call's it keeps
    with pytest.raises(picofx.CaptureError, match="use_cache=False") as info:
        picofx.optimize(z.model, {"input_ids": z.example_inputs["input_ids"], "use_cache": True}, backend="eager")
    shown = "".join(traceback.format_exception(info.value))
    assert "The above exception was the direct cause" not in shown and len(shown.splitlines()) < 40
    assert info.value.torch_error is not None  # torch's own error stays reachable


def test_a_wrong_input_names_the_argument_and_both_shapes():
    model = two_linears()
    opt = picofx.optimize(model, (torch.randn(4, 8),), backend="eager", recapture=False)
    with pytest.raises(picofx.InputShapeError,
                       match=r"^argument 0 has shape \(4, 9\), but the graph was captured with \(4, 8\) "
                             r"\(dimension 1: 9 vs 8\)"):
        opt(torch.randn(4, 9))


def test_a_misspelt_argument_is_named_before_the_capture_and_a_missing_one_after_it():
    z = zoo.build("llama-tiny")
    ids, labels = z.example_inputs["input_ids"], z.example_inputs["labels"]
    with pytest.raises(picofx.CaptureError, match=r"Llama\.forward takes no argument 'input_id' \(it takes "
                                                  r"input_ids\); did you mean 'input_ids'\?"):
        picofx.optimize(z.model, {"input_id": ids, "labels": labels}, backend="eager", loss_fn=z.loss_fn)
    opt = picofx.optimize(z.model, z.example_inputs, backend="eager", loss_fn=z.loss_fn, recapture=False)
    with pytest.raises(picofx.InputShapeError, match="the call passes input_ids, the graph was captured with "
                                                     "input_ids, labels"):
        opt(input_ids=ids)


def test_loss_fn_for_a_model_that_computes_its_own_loss_says_to_drop_it():
    h, ref = zoo.build("hf-llama-tiny"), zoo.build("llama-tiny")
    with pytest.raises(picofx.CaptureError, match=r"LlamaForCausalLM\.forward takes labels and computes its own "
                                                  r"loss: drop loss_fn"):
        picofx.optimize(h.model, h.example_inputs, backend="eager", loss_fn=ref.loss_fn)


def test_labels_without_loss_fn_for_a_model_that_returns_logits_asks_for_loss_fn():
    z = zoo.build("llama-tiny")
    with pytest.raises(picofx.CaptureError, match=r"Llama\.forward takes no 'labels'.*pass loss_fn="):
        picofx.optimize(z.model, z.example_inputs, backend="eager")


# ---- 5. a recompilation prints one line and is counted ------------------------------------------

def test_a_new_shape_prints_one_line_and_the_report_counts_it(capsys):
    model = two_linears()
    opt = picofx.optimize(model, (torch.randn(4, 8),), backend="eager")
    assert capsys.readouterr().err == ""  # the first capture is silent
    opt(torch.randn(3, 8)).sum().backward()
    err = capsys.readouterr().err
    assert re.fullmatch(r"picofx: argument 0 \(4, 8\) -> \(3, 8\): captured and compiled again in "
                        r"\d+\.\ds \(recompilation 1\)\n", err), err
    opt(torch.randn(4, 8))  # seen before: no line, no recompilation
    assert capsys.readouterr().err == "" and opt.report.recompilations == 1
    assert "captured and compiled 2 times (1 recompilations" in opt.report.table()
    assert json.loads(opt.report.to_json())["recompilations"] == 1
    logging.getLogger("picofx").setLevel(logging.WARNING)  # as the README says to silence it
    try:
        opt(torch.randn(5, 8))
    finally:
        logging.getLogger("picofx").setLevel(logging.INFO)
    assert capsys.readouterr().err == "" and opt.report.recompilations == 2


# ---- 6. quiet: nothing on the terminal but what picofx means to say ------------------------------

QUIET = """
import torch, picofx
from picofx.models import zoo
z = zoo.build("llama-tiny")
passes = [picofx.passes.Fuse(rules=("rms_norm",)), picofx.passes.Checkpoint(budget="1GiB")]
opt = picofx.optimize(z.model, z.example_inputs, passes, backend="eager", loss_fn=z.loss_fn)
opt(**zoo.build("llama-tiny", seq=16).example_inputs).backward()
"""


def test_optimize_prints_no_warnings_and_no_profiler_lines():
    result = subprocess.run([sys.executable, "-W", "default", "-c", QUIET], capture_output=True, text=True,
                            cwd=ROOT / "tests", timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("picofx: input_ids (2, 32) -> (2, 16)"), result.stderr


# ---- 7. the report ---------------------------------------------------------------------------------

def record(name, stage, notes):
    return PassRecord(name=name, stage=stage, graph_role=stage.value, seconds=0.01, nodes_before=10,
                      nodes_after=9, added=[], removed=["x"], changed=True, notes=notes)


def test_the_report_fits_100_columns_says_bytes_in_units_and_prints_what_passes_explain():
    misses = [dataclasses.asdict(NearMiss("rms_norm", "mul_3 (model.norm)", "same_eps", "eps differs: 1e-5 vs 1e-6"))]
    per_layer = {f"decoder_layers.{i}": {"saved": ["mm_1 (attention.q_proj)"], "recomputed": ["silu (mlp)"]}
                 for i in range(2)}
    checkpoint = {"budget": 3 * 2**30, "peak_before": 5 * 2**30, "peak_after": 3 * 2**30 - 2**20,
                  "bytes_saved": 3 * 2**29, "added_flops": 0, "recomputed": 12, "per_layer": per_layer,
                  "memory": {"parameters": 2**30, "gradients": 2**30, "backward_peak_at": "mm_19"}}
    fuse = {rule: i for i, rule in enumerate(["rms_norm", "add_rms_norm", "swiglu", "gated_activation", "rope",
                                              "attention", "grouped_query_attention", "linear_cross_entropy"])}
    report = Report("eager", (), records=[record("fuse", Stage.FORWARD, {**fuse, "near_misses": misses}),
                                          record("checkpoint", Stage.JOINT, checkpoint)])
    text = str(report)
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    assert "budget=3.00 GiB" in text and "peak_after=3.00 GiB" in text and "bytes_saved=1.50 GiB" in text
    assert "recomputed=12 views/free ops (0 FLOPs)" in text and "added_flops" not in text
    assert "rms_norm at mul_3 (model.norm): eps differs: 1e-5 vs 1e-6 [same_eps]" in text
    assert "decoder_layers.1: saves 1, recomputes 1: silu (mlp)" in text
    assert "parameters=1.00 GiB" in text
    wide = report.table(wide=True)
    assert max(len(line) for line in wide.splitlines()) > WIDTH  # every note of a pass on its one line
    assert json.loads(report.to_json())["passes"][1]["notes"]["budget"] == 3 * 2**30


# ---- 8. the training script ------------------------------------------------------------------------

def load_train_script():
    from picofx.cli import train

    return train


def test_train_script_help_gives_every_option_a_text_and_its_default(capsys):
    train = load_train_script()
    with pytest.raises(SystemExit) as info:
        train.parse_args(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    blocks = re.split(r"\n  (?=-)", text.split("options:")[1])[1:]
    assert len(blocks) >= 10
    for block in blocks:
        if not block.startswith("-h"):
            assert "default" in block, block


def test_train_script_reports_mean_throughput_mfu_by_dtype_and_a_summary(capsys):
    train = load_train_script()
    result = train.main(["--backend", "eager", "--steps", "4", "--batch", "2", "--seq", "32", "--log-every", "2",
                         "--passes"])
    assert len(result["history"]) == 2 and result["tokens_per_s"] > 0
    out = capsys.readouterr().out
    assert re.search(r"tokens/s: [\d,]+ over the run", out)
    assert re.search(r"MFU [\d.]+% of the measured fp32 peak, [\d,]+ GFLOP/s \(a 1024 x 1024 matmul on \d+ threads?\)",
                     out) and "summary" in out.lower()


def test_train_script_offers_sizes_that_fit_and_refuses_one_that_does_not(capsys):
    from picofx.cli.train_parser import fits

    train = load_train_script()
    args = train.parse_args([])
    assert fits(args.size, args.batch, args.seq, args.device)
    with pytest.raises(SystemExit) as info:
        train.parse_args(["--size", "llama2-7b"])  # about 106 GiB a step against the CPU's 16 GiB
    assert info.value.code == 2
    assert re.search(r"--size llama2-7b needs about [\d.]+ GiB per step .* cpu has", capsys.readouterr().err)


# ---- 9. picofx dump ----------------------------------------------------------------------------------

def test_dump_help_lists_passes_with_options_and_the_formats(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["dump", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert re.search(r"checkpoint +joint stage; options: budget=None", text)
    assert re.search(r"fuse +forward stage; options: .*explain=False", text)
    assert "--budget" in text and re.search(r"text +one row per node", text) and re.search(r"dot +the", text)
    assert "Exit status: 0 done, 1" in text


def test_dump_exit_codes(capsys, tmp_path):
    assert cli_main(["dump", "llama-tiny", "--budget", "1GiB"]) == 2  # --budget without checkpoint
    assert "add checkpoint to --passes" in capsys.readouterr().err
    assert cli_main(["dump", "llama-tiny", "--passes", "checkpoint", "--budget", "8G"]) == 2
    assert "ambiguous" in capsys.readouterr().err
    assert cli_main(["dump", "no-such-model"]) == 2
    with pytest.raises(SystemExit) as info:
        cli_main(["dump", "llama-tiny", "--format", "svg"])
    assert info.value.code == 2
    capsys.readouterr()
    assert cli_main(["dump", "llama-tiny", "--passes", "checkpoint", "--budget", "1000"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("picofx dump: pass 'checkpoint'") and "Traceback" not in err
    broken = tmp_path / "broken.py"
    broken.write_text("def build():\n    raise RuntimeError('no weights here')\n")
    assert cli_main(["dump", f"{broken}:build"]) == 1
    assert "the model failed: RuntimeError: no weights here" in capsys.readouterr().err
