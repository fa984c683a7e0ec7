import importlib
import tempfile

import pytest
import torch

PICOFX_TRAIN = ["-m", "picofx", "train"]
ELSEWHERE = tempfile.gettempdir()  # the command runs from any directory, not only the checkout


def test_main_job_trains_with_fuse_and_the_loss_falls(capsys):
    train = importlib.import_module("picofx.cli.train")
    result = train.main(["--backend", "eager", "--steps", "40", "--batch", "4", "--seq", "64",
                         "--log-every", "10", "--passes", "fuse"])
    losses = [entry["loss"] for entry in result["history"]]
    assert losses[-1] < losses[0] - 1.0, losses
    out = capsys.readouterr().out
    assert "over the run" in out and "MFU" in out and "fuse" in out and "rms_norm=" in out


def test_the_summary_gives_the_first_and_the_last_steps_loss(capsys):
    """Fewer steps than --log-every: one interval, whose mean is neither."""
    train = importlib.import_module("picofx.cli.train")
    result = train.main(["--backend", "eager", "--steps", "3", "--batch", "2", "--seq", "16", "--passes"])
    first, last = (f"{loss:.3f}" for loss in (result["losses"][0], result["losses"][-1]))
    assert first != last
    assert f"loss {first} -> {last}, first step to last" in capsys.readouterr().out


def test_more_threads_than_cores_is_warned_once(capsys):
    from picofx.cost.device import available_cores

    train = importlib.import_module("picofx.cli.train")
    threads = torch.get_num_threads()
    torch.set_num_threads(available_cores() + 1)
    try:
        train.main(["--backend", "eager", "--steps", "1", "--batch", "2", "--seq", "16", "--passes"])
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    assert f"on cpu ({available_cores() + 1} threads)" in captured.out
    warnings = [line for line in captured.err.splitlines() if line.startswith("picofx train: warning: ")]
    assert len(warnings) == 1 and f"more than the {available_cores()} cores" in warnings[0], captured.err


def test_pipelined_training_under_torchrun_reports_its_cut_and_a_validation_loss():
    import os
    import re
    import signal
    import subprocess
    import sys

    # --standalone: torchrun picks a free port for its own rendezvous
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               *PICOFX_TRAIN, "--pp", "2", "--backend", "eager", "--passes", "--steps", "4", "--batch", "4",
               "--seq", "32"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True, cwd=ELSEWHERE)
    try:
        out = proc.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started, nothing else
        raise AssertionError(f"torchrun --pp 2 still running after 240 s; killed:\n{proc.communicate()[0][-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    validation = re.search(r"loss [\d.]+ -> [\d.]+, first step to last \(validation ([\d.]+)\)", out)
    assert validation and 0 < float(validation.group(1)) < 10, out[-3000:]
    assert "pipeline:" in out and "cut 1: before" in out and "bubble" in out
    assert "2 ranks: 2 pipeline stages" in out, out[-3000:]
    assert "of the measured fp32 peak" in out and "GFLOP/s per rank x 2 ranks" in out, out[-3000:]
    flops = re.search(r"([\d.]+) MFLOP/token by 6N\+12LHT, ([\d.]+) MFLOP/token in the captured graphs", out)
    palm, graphs = float(flops.group(1)), float(flops.group(2))
    assert abs(graphs - palm) < 0.1 * palm, out[-3000:]  # every stage and micro-batch, not one stage's one


def run_script(args: list, timeout: float = 120, torchrun_ranks: int | None = None):
    """`picofx train` as a user runs it: (exit status, stdout + stderr). Under torchrun its whole process
    group (torchrun and the ranks it started, nothing else) is killed at the timeout."""
    import os
    import signal
    import subprocess
    import sys

    launcher = [sys.executable] if torchrun_ranks is None else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun_ranks)]
    proc = subprocess.Popen([*launcher, *PICOFX_TRAIN, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                            cwd=ELSEWHERE)
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{args} still running after {timeout} s; killed:\n{proc.communicate()[0][-3000:]}")
    return proc.returncode, out


def picofx_lines(out: str) -> list[str]:
    """The script's own lines: torchrun's warnings and its failure summary left out."""
    summary = out.find("Traceback (most recent call last):\n  File \"") if "ChildFailedError" in out else -1
    kept = out[:summary] if summary >= 0 else out
    return [line for line in kept.splitlines() if line.strip() and not line.startswith(("W1", "E1", "*"))
            and "OMP_NUM_THREADS" not in line]


BAD_OPTIONS = {  # arguments -> what the one line must say
    "batch 0": (["--batch", "0"], "--batch: must be at least 1, got 0"),
    "steps 0": (["--steps", "0"], "--steps: must be at least 1, got 0"),
    "unknown pass": (["--passes", "fusion"], "unknown pass 'fusion'; available passes:"),
    "dp without torchrun": (["--dp", "2"], "launch it with torchrun, e.g. torchrun --nproc-per-node 2"),
    "pp without torchrun": (["--pp", "2", "--dp", "2"], "torchrun --nproc-per-node 4 -m picofx train"),
    "overlap on one process": (["--passes", "overlap"], "one process has none"),
    "seq over the position limit": (["--seq", "4096"], "position limit, 128 (max_position_embeddings): pass "
                                                       "--max-positions 4096"),
    "budget without checkpoint": (["--memory-budget", "2GiB"], "add checkpoint to --passes"),
    "ambiguous budget": (["--passes", "checkpoint", "--memory-budget", "2G"], "write '2GiB'"),
    "missing data": (["--data", "/nonexistent/corpus.txt"], "--data /nonexistent/corpus.txt: no such file"),
    "pass added by the layout": (["--passes", "pipeline"], "adds it from --pp"),
    "compress without torchrun": (["--compress", "int8"], "it needs --dp or --shard under torchrun"),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_a_bad_option_is_one_line_and_exit_2_before_anything_runs(case):
    args, expected = BAD_OPTIONS[case]
    code, out = run_script(args)
    lines = picofx_lines(out)
    assert code == 2 and len(lines) == 1 and expected in lines[0], out
    assert lines[0].startswith("picofx train: error: ") and "Traceback" not in out, out
    if case == "unknown pass":
        assert lines[0].endswith("did you mean 'fuse'?"), out


def test_paths_that_cannot_be_used_are_refused(tmp_path):
    a_file = tmp_path / "graphs.txt"
    a_file.write_text("not a directory")
    code, out = run_script(["--dump-dir", str(a_file / "sub"), "--resume", str(tmp_path)])
    assert code == 2 and picofx_lines(out) == [f"picofx train: error: --dump-dir {a_file / 'sub'}: {a_file} is a "
                                               "file, not a directory: name a directory (it is created if missing)"]
    code, out = run_script(["--resume", str(tmp_path)])
    assert code == 2 and "no checkpoint there" in out and len(picofx_lines(out)) == 1, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: --device cuda is valid here")
def test_cuda_without_a_gpu_says_so():
    code, out = run_script(["--device", "cuda"])
    lines = picofx_lines(out)
    assert code == 2 and len(lines) == 1 and "torch sees no CUDA GPU here" in lines[0] and "--device cpu" in lines[0]


def test_data_too_short_for_the_sequence_stops_with_one_line(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("hello world\n" * 10)
    code, out = run_script(["--data", str(corpus), "--seq", "64", "--backend", "eager"])
    lines = picofx_lines(out)
    assert code == 1 and "Traceback" not in out, out
    assert lines[-1].startswith("picofx train: error: the data holds 120 tokens; --seq 64 needs"), out


def test_a_text_file_is_the_training_data(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    train = importlib.import_module("picofx.cli.train")
    result = train.main(["--data", str(corpus), "--backend", "eager", "--passes", "--steps", "30", "--batch", "4",
                         "--seq", "32", "--log-every", "10", "--lr", "1e-2"])
    losses = [entry["loss"] for entry in result["history"]]
    assert losses[-1] < losses[0] - 1.0, losses  # one repeated sentence: learnt fast


def test_a_saved_dataset_is_the_training_data(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["the quick brown fox"] * 300}).save_to_disk(str(tmp_path / "ds"))
    train = importlib.import_module("picofx.cli.train")
    result = train.main(["--data", str(tmp_path / "ds"), "--backend", "eager", "--passes", "--steps", "2",
                         "--batch", "2", "--seq", "16"])
    assert len(result["losses"]) == 2


def test_under_torchrun_a_layout_that_does_not_match_the_ranks_is_refused_once():
    code, out = run_script(["--dp", "2"], torchrun_ranks=3, timeout=180)
    lines = picofx_lines(out)
    assert code != 0 and lines == ["picofx train: error: the layout --dp 2 x --tp 1 x --pp 1 is 2 ranks, but "
                                   "torchrun started 3: launch with --nproc-per-node 2, or change --dp/--tp/--pp"], out


def test_under_torchrun_an_error_after_setup_is_printed_once_and_every_rank_stops():
    # a budget no plan can meet: every rank's checkpoint pass raises after the process group started
    code, out = run_script(["--backend", "eager", "--passes", "checkpoint", "--memory-budget", "1000",
                            "--batch", "2", "--seq", "16", "--steps", "2"], torchrun_ranks=2, timeout=240)
    errors = [line for line in picofx_lines(out) if "error" in line]
    assert code != 0 and len(errors) == 1, out
    assert errors[0].startswith("picofx train: error: pass 'checkpoint'") and "below the smallest peak" in errors[0]
    assert out.count("Traceback") <= 1 and "ChildFailedError" in out  # torchrun's own summary, no rank's
    assert "data parallel, 2 replicas" in out and "(the default under torchrun" in out
