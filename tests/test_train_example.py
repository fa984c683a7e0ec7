import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).parents[1] / "examples" / "train_llama.py"


def test_main_job_trains_with_fuse_and_the_loss_falls(capsys):
    spec = importlib.util.spec_from_file_location("train_llama", SCRIPT)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    result = train.main(["--backend", "eager", "--steps", "40", "--batch", "4", "--seq", "64",
                         "--log-every", "10", "--passes", "fuse"])
    losses = [entry["loss"] for entry in result["history"]]
    assert losses[-1] < losses[0] - 1.0, losses
    out = capsys.readouterr().out
    assert "over the run" in out and "MFU" in out and "fuse" in out and "rms_norm=" in out
