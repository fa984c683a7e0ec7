"""A new user's first hour with picofx train (issue 48): an unwritable --save found before any
training; Ctrl-C saving at the step boundary like SIGTERM (exit 130), a second Ctrl-C stopping at
once; DataLoader workers that outlive a signal to the whole process tree, so that the rank
checkpoints and the run resumes bit for bit; --resume auto on a finished run exiting 0."""
import importlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import picofx.cli
from picofx.runtime import checkpoints

FAST = ["--backend", "eager", "--passes", "--batch", "2", "--seq", "16", "--log-every", "1"]
ROOT = pathlib.Path(__file__).parents[2]


def train(argv: list) -> dict:
    return importlib.import_module("picofx.cli.train").main(argv)


def steps_in(root) -> dict:
    return {step: checkpoints.is_complete(path) for step, path in checkpoints.saved_steps(root)}


def unwritable(tmp_path) -> str:
    """A directory this process cannot create: under a read-only one, or (as root, whom permissions
    do not stop) under sysfs, which refuses new directories."""
    if os.geteuid() != 0:
        tmp_path.chmod(0o500)
        return str(tmp_path / "run")
    if not pathlib.Path("/sys/kernel").is_dir():
        pytest.skip("running as root without sysfs: no directory here refuses a write")
    return "/sys/picofx-first-hour-test/run"


def test_an_unwritable_save_directory_stops_every_rank_before_any_training(tmp_path, capsys, monkeypatch):
    module = importlib.import_module("picofx.cli.train")
    monkeypatch.setattr(module, "setup", lambda *a: pytest.fail("the run was set up before --save was checked"))
    save = unwritable(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        train([*FAST, "--steps", "2", "--save", save])
    err = capsys.readouterr().err
    assert exit_.value.code == 1
    assert f"picofx train: error: --save {save}: cannot write there: " in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def signal_on_optimizer_step(monkeypatch, at: int, signals: list) -> None:
    """Send `signals` to this process during the optimizer's step number `at`."""
    original, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            for number in signals:
                os.kill(os.getpid(), number)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


def exit_status(argv: list) -> int:
    """picofx train's exit status for a run that must stop by SystemExit, a KeyboardInterrupt (which
    pytest would take as the user stopping the session) turned into this test's failure."""
    try:
        train(argv)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C came out of picofx train as a KeyboardInterrupt (a traceback)")
    except SystemExit as e:
        return e.code
    pytest.fail("the run went on to its end after Ctrl-C")


def test_ctrl_c_saves_at_the_step_boundary_and_exits_130(tmp_path, capfd, monkeypatch):
    """The checkpoint is the one SIGTERM writes (whose resume tests/cli/test_train_checkpoints.py and
    the process-tree test below check bit for bit)."""
    root = str(tmp_path / "run")
    handler = signal.getsignal(signal.SIGINT)
    signal_on_optimizer_step(monkeypatch, 2, [signal.SIGINT])
    status = exit_status([*FAST, "--steps", "4", "--save", root])
    out, err = capfd.readouterr()  # the notice is written to file descriptor 2 from the signal handler
    assert status == 130
    assert "stopped by Ctrl-C after step 2, saved to" in out and "Traceback" not in err
    assert "Ctrl-C: saving at the end of this step" in err
    assert steps_in(root) == {2: True} and signal.getsignal(signal.SIGINT) is handler


@pytest.mark.parametrize("save", [True, False], ids=["second-ctrl-c", "without-save"])
def test_ctrl_c_without_a_checkpoint_to_wait_for_stops_at_once_in_one_line(tmp_path, capsys, monkeypatch, save):
    root = str(tmp_path / "run")
    handler = signal.getsignal(signal.SIGINT)
    signal_on_optimizer_step(monkeypatch, 2, [signal.SIGINT, signal.SIGINT] if save else [signal.SIGINT])
    status = exit_status([*FAST, "--steps", "4", *(["--save", root] if save else [])])
    err = capsys.readouterr().err
    assert status == 130 and "Traceback" not in err
    said = "stopped by a second Ctrl-C, the step in progress not saved" if save else \
        "stopped by Ctrl-C, nothing saved (pass --save DIR to checkpoint at the step boundary)"
    assert err.strip().splitlines()[-1] == f"picofx train: {said}", err
    assert steps_in(root) == {} and signal.getsignal(signal.SIGINT) is handler


def test_resume_auto_on_a_finished_run_exits_0_saying_so(tmp_path, capsys):
    root = str(tmp_path / "run")
    train([*FAST, "--steps", "2", "--save", root])
    capsys.readouterr()
    assert picofx.cli.main(["train", *FAST, "--steps", "2", "--save", root, "--resume", "auto"]) == 0
    assert capsys.readouterr().out == (f"picofx train: --resume auto: the run under --save {root} is complete (saved "
                                       "after step 2, --steps 2): nothing to do\n")
    with pytest.raises(SystemExit) as exit_:  # a checkpoint named outright is still one to go on from
        train([*FAST, "--steps", "2", "--resume", root])
    assert exit_.value.code == 2 and "pass a larger --steps" in capsys.readouterr().err


def children_of(pid: int) -> list[int]:
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_a_signal_to_the_whole_process_tree_checkpoints_and_the_run_resumes_bit_for_bit(tmp_path):
    """As SLURM's scancel does: SIGTERM to the rank and to its DataLoader worker at once."""
    root = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "picofx", "train", *FAST, "--steps", "500", "--save", root, "--data-workers", "1"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in job.stdout:
            if line.startswith("step     2"):
                break
        workers = children_of(job.pid)
        assert workers, "the run has no DataLoader worker to signal"
        for pid in [*workers, job.pid]:
            os.kill(pid, signal.SIGTERM)
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    stopped = max((step for step, complete in steps_in(root).items() if complete), default=None)
    assert stopped is not None, f"no checkpoint was saved: {err[-2000:]}"
    assert job.returncode == 0 and f"stopped by SIGTERM after step {stopped}" in out, err[-2000:]
    assert "killed by signal" not in err and "Traceback" not in err, err[-2000:]
    straight = train([*FAST, "--steps", str(stopped + 2)])["losses"]
    resumed = train([*FAST, "--steps", str(stopped + 2), "--save", root, "--resume", "auto"])["losses"]
    assert resumed == straight[stopped:]


def test_a_plain_hugging_face_llama_is_captured_with_its_cache_off_and_put_back():
    """LlamaForCausalLM's config says use_cache=True, as from_pretrained gives it: picofx captures
    the training step without the cache and leaves the config as it found it (for generate)."""
    import picofx
    from picofx.models import zoo

    z = zoo.hf_llama("tiny", use_cache=True)
    reference = z.model(**z.example_inputs).loss
    opt = picofx.optimize(z.model, z.example_inputs, backend="eager")
    loss = opt(**z.example_inputs).loss  # an HF model returns its output object: the docs' loop takes .loss
    loss.backward()
    assert z.model.config.use_cache is True
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)


def test_the_small_items_of_the_first_hour(capsys):
    """'picofx plan: ' said once; `picofx dump --help` shows no pass's own state; one core is "1
    core"; the layout auto line says what "mb" is."""
    from types import SimpleNamespace

    from picofx.cli.dump import pass_summary
    from picofx.cli.train_layout import explain
    from picofx.cost.device import cpu
    from picofx.planner.layouts import Layout

    assert picofx.cli.main(["plan", "no-such-model", "--gpus", "2", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("picofx plan: unknown model 'no-such-model'") and err.count("picofx plan:") == 1, err
    summary = pass_summary()
    assert "WeakKeyDictionary" not in summary and "states=" not in summary and "overlap" in summary
    assert cpu(1).name == "CPU (1 core, nominal)" and cpu(2).name == "CPU (2 cores, nominal)"
    chosen = SimpleNamespace(layout=Layout(dp=1, tp=1, pp=2, microbatches=4), fits=True, step_s=0.1,
                             memory_per_gpu=1e6, bottleneck="compute")
    plans = SimpleNamespace(predictions=[chosen], run=SimpleNamespace(gpus=2, device=cpu(1)))
    assert "4 mb" in explain(plans, 0) and "mb: the micro-batches a step's batch is split into" in explain(plans, 0)


def test_a_json_lines_data_file_trains_on_each_lines_text_field(tmp_path):
    from picofx.cli.train_data import DataError, documents, load_tokens

    data = tmp_path / "notes.jsonl"
    data.write_text('{"text": "the first note", "id": 1}\n\n{"text": "and \\u00e9 second"}\n')
    assert bytes(load_tokens(str(data)).to(torch.uint8).tolist()) == "the first note\nand \u00e9 second".encode()
    assert list(documents(str(data))) == [["the first note"], ["and \u00e9 second"]]
    data.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"notes.jsonl: line 2 has no text field \(looked for text, content; it has "
                                        r"body\)"):
        load_tokens(str(data))
    data.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(DataError, match=r"notes.jsonl: line 2 is not JSON"):
        list(documents(str(data)))


def test_an_exported_model_is_readable_as_the_umask_allows(tmp_path):
    from transformers import LlamaConfig

    from picofx.cli.export import write_folder

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    mask = os.umask(0o022)
    try:
        write_folder(tmp_path / "out", {"model.embed_tokens.weight": torch.zeros(16, 8)}, config, None)
    finally:
        os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert modes["model.safetensors"] == 0o644 and modes["config.json"] == 0o644, modes


def test_a_hub_name_fails_at_once_where_the_hub_does_not_answer(monkeypatch):
    """Not after the hub libraries' half a minute of retries: a closed port stands for no network."""
    import datasets
    import huggingface_hub.constants

    from picofx.cli.train_data import DataError, dataset_rows

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # put back as it was, with the libraries' switches:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", huggingface_hub.constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    started = time.perf_counter()
    with pytest.raises(DataError, match=r"^--data someone/no-such-data: datasets could not load it \(the hub did "
                                        r"not answer: only a copy in the local cache could load\)"):
        dataset_rows("someone/no-such-data")
    assert time.perf_counter() - started < 10
    assert os.environ["HF_HUB_OFFLINE"] == "1" and datasets.config.HF_HUB_OFFLINE


def test_the_cpu_peak_is_measured_once_per_machine_and_the_mfu_line_says_when(monkeypatch, tmp_path):
    from picofx.cli import train_metrics
    from picofx.cli.train_metrics import Throughput, rank_peak
    from picofx.planner.layouts import Layout

    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path))
    measured = iter([50e9, 20e9, 30e9])
    monkeypatch.setattr(train_metrics, "matmul_flops", lambda dtype, device, **_: next(measured))
    first, again = rank_peak("cpu", torch.float32, Layout()), rank_peak("cpu", torch.float32, Layout())
    assert first.flops == again.flops == 50e9 and len(list((tmp_path / "peaks").iterdir())) == 1
    assert re.fullmatch(r"measured \d{4}-\d\d-\d\d \d\d:\d\d UTC, now \(kept in picofx's cache for later runs\)",
                        first.when), first.when
    assert again.when == first.when.replace("now (kept in picofx's cache for later runs)", "read from picofx's cache")
    line = Throughput(0.5, 1e6, 1e6, again).line(Layout())
    assert f"(a 1024 x 1024 matmul on {torch.get_num_threads()} thread" in line and again.when in line
    # two ranks: the other has no figure for its key, so both measure (the other's 10e9 summed in)
    assert rank_peak("cpu", torch.float32, Layout(dp=2), total=lambda x: x + 10e9).flops == 15e9


def test_mfu_and_the_captured_flops_count_every_context_parallel_rank():
    """--cp 2: the MFU divides by both ranks' peak (it had one rank's: doubled), and the captured
    FLOPs per token sum both ranks' halves of each sequence (it had one rank's: halved)."""
    from types import SimpleNamespace

    from picofx.cli.train_metrics import captured_flops_per_token, model_flops_utilization
    from picofx.planner.layouts import Layout

    layout = Layout(cp=2)
    assert layout.gpus == 2
    assert model_flops_utilization(100.0, 10.0, 1000.0, layout) == 100.0 * 10.0 / (1000.0 * 2)
    assert captured_flops_per_token(50.0, 10, layout, total=lambda x: 2 * x) == 10.0  # both halves, one replica


def test_precision_on_a_cpu_without_bf16_matmul_units_warns_once_with_its_measured_cost(monkeypatch, tmp_path):
    """The rates are measured once per machine, kept beside the CPU peak; a CPU with bf16 units is told nothing."""
    import warnings

    import picofx
    from picofx.passes.precision import precision
    from picofx.passes.precision.precision import PrecisionCostWarning, warn_if_slower_on_cpu
    from picofx.runtime import peaks

    monkeypatch.setattr(precision, "WARNED_CPU_COST", set())  # as a fresh process

    measured, rates = [], {torch.float32: 40e9, torch.bfloat16: 10e9}
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path / "slow"))
    monkeypatch.setattr(peaks, "matmul_flops", lambda dtype, device, **_: measured.append(dtype) or rates[dtype])
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Flatten(0))  # a matmul, as small as it gets
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        picofx.optimize(model, {"input": torch.randn(4, 8)}, passes=["precision"], backend="eager")
        warn_if_slower_on_cpu(torch.bfloat16)  # as a second optimize would
    shown = [str(w.message) for w in caught if issubclass(w.category, PrecisionCostWarning)]
    assert len(shown) == 1, "\n".join(shown)
    assert shown[0].startswith(
        "precision: bfloat16 matmuls run at 10 GFLOP/s on this CPU against 40 GFLOP/s in fp32 (4.0x slower"), shown
    assert measured == [torch.float32, torch.bfloat16]
    assert re.search(r"units; measured \d{4}-\d\d-\d\d \d\d:\d\d UTC\)", shown[0]), shown[0]
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path / "fast"))
    rates[torch.bfloat16] = 160e9
    monkeypatch.setattr(precision, "WARNED_CPU_COST", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        warn_if_slower_on_cpu(torch.bfloat16)
    assert not [w for w in caught if issubclass(w.category, PrecisionCostWarning)]
