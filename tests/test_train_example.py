import importlib
import pathlib

SCRIPT = pathlib.Path(__file__).parents[1] / "examples" / "train_llama.py"


def test_main_job_trains_with_fuse_and_the_loss_falls(capsys):
    train = importlib.import_module("picofx.examples.train_llama")
    result = train.main(["--backend", "eager", "--steps", "40", "--batch", "4", "--seq", "64",
                         "--log-every", "10", "--passes", "fuse"])
    losses = [entry["loss"] for entry in result["history"]]
    assert losses[-1] < losses[0] - 1.0, losses
    out = capsys.readouterr().out
    assert "over the run" in out and "MFU" in out and "fuse" in out and "rms_norm=" in out


def test_pipelined_training_under_torchrun_reports_its_cut_and_a_validation_loss():
    import os
    import re
    import signal
    import subprocess
    import sys

    # --standalone: torchrun picks a free port for its own rendezvous
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(SCRIPT), "--pp", "2", "--backend", "eager", "--passes", "--steps", "4", "--batch", "4", "--seq", "32"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        out = proc.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started, nothing else
        raise AssertionError(f"torchrun --pp 2 still running after 240 s; killed:\n{proc.communicate()[0][-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    validation = re.search(r"loss [\d.]+ -> [\d.]+ \(validation ([\d.]+)\)", out)
    assert validation and 0 < float(validation.group(1)) < 10, out[-3000:]
    assert "pipeline:" in out and "cut 1: before" in out and "bubble" in out
