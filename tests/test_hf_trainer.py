"""The optimized module under Hugging Face `Trainer` and `accelerate`, as a user passes it.

Default `TrainingArguments` (CPU, no reporting; batch and step counts set): columns kept and labels
found from the optimized module's signature, training and evaluation (`eval_loss`) with the plain
model's numbers, checkpoints in the plain model's format, resuming with the losses of an
uninterrupted run. Two ranks under torchrun: gradients equal the single-process full batch.

Run as a script (`torchrun --nproc-per-node 2 tests/test_hf_trainer.py OUT VARIANT...`), this file
is the ranks' program: each variant trains one step and saves its batch and gradients.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import picofx  # noqa: E402
from picofx.models import zoo  # noqa: E402
from picofx.manager import PASSES  # noqa: E402
from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.utils.generic import find_labels  # noqa: E402

SEQ, VOCAB_SEED, RANKS_TIMEOUT_S = 16, 1, 240
EXAMPLE = Path(__file__).parents[1] / "examples" / "train_hf_trainer.py"


class Tokens(torch.utils.data.Dataset):
    """Random token rows; `index` is a column no model takes: Trainer must drop it."""

    def __init__(self, rows: int, seed: int, vocab: int, seq: int = SEQ):
        self.ids = zoo.token_batch(vocab, rows, seq, seed)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i], "index": i}


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(zoo.hf_llama_config("tiny", num_hidden_layers=1))  # one layer: captures cost less


def example_batch(model, batch: int = 2) -> dict:
    ids = zoo.token_batch(model.config.vocab_size, batch, SEQ, 0)
    # Trainer passes the batch's label count to a model whose forward takes **kwargs
    return {"input_ids": ids, "labels": ids, "num_items_in_batch": torch.tensor(float(batch * (SEQ - 1)))}


def arguments(output_dir, **overrides) -> TrainingArguments:
    fields = dict(output_dir=str(output_dir), use_cpu=True, report_to=[], per_device_train_batch_size=2,
                  per_device_eval_batch_size=2, max_steps=4, logging_steps=1, save_steps=2, eval_strategy="steps",
                  eval_steps=2, disable_tqdm=True)
    return TrainingArguments(**{**fields, **overrides})


def trainer(model, output_dir, **overrides) -> Trainer:
    vocab = model.config.vocab_size
    return Trainer(model=model, args=arguments(output_dir, **overrides),
                   train_dataset=Tokens(8, VOCAB_SEED, vocab), eval_dataset=Tokens(4, VOCAB_SEED + 1, vocab))


def logged(history: list[dict], key: str) -> list[float]:
    return [entry[key] for entry in history if key in entry]


# ---- what Trainer reads from the model ---------------------------------------------------------------

def test_the_optimized_module_reads_like_the_model():
    model = tiny_model()
    opt = picofx.optimize(model, example_batch(model), passes=[], backend="eager")
    assert inspect.signature(opt.forward) == inspect.signature(model.forward)
    assert isinstance(opt, LlamaForCausalLM) and isinstance(opt, picofx.OptimizedModule)
    assert find_labels(type(opt)) == ["labels"]
    assert opt.config is model.config and opt.main_input_name == "input_ids"
    assert opt.num_parameters(exclude_embeddings=True) == model.num_parameters(exclude_embeddings=True)
    assert not opt.can_generate() and not opt.syncs_gradients
    with pytest.raises(NotImplementedError, match="generate with the model"):
        opt.generate(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"picofx.passes.Checkpoint\(budget=...\)"):
        opt.gradient_checkpointing_enable()
    assert list(opt.state_dict()) == list(model.state_dict())


class ShiftedTokens(Tokens):
    """Rows of SEQ + 1 tokens as a logits model's inputs and next-token labels."""

    def __getitem__(self, i):
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:], "index": i}


def test_a_loss_fn_model_takes_labels_and_trains_under_trainer(tmp_path):
    ref = zoo.build("gpt2-tiny", batch=2, seq=SEQ)
    expected = ref.loss_fn(ref.model(ref.example_inputs["input_ids"]), ref.example_inputs["labels"])
    # Trainer reads the loss from a dict (or the first element of a tuple), not from a bare tensor
    opt = picofx.optimize(ref.model, ref.example_inputs, passes=[], backend="eager",
                          loss_fn=lambda out, labels: {"loss": ref.loss_fn(out, labels)})
    params = inspect.signature(opt.forward).parameters
    assert list(params) == [*inspect.signature(ref.model.forward).parameters, "labels"]
    assert find_labels(type(opt)) == ["labels"] and opt.main_input_name == "input_ids"
    assert not isinstance(opt, transformers.PreTrainedModel)
    torch.testing.assert_close(opt(**ref.example_inputs)["loss"], expected)

    vocab = ref.model.lm_head.out_features
    # save_strategy="no": Trainer saves a model that is not a PreTrainedModel as a bare safetensors
    # state dict, which refuses GPT-2's tied embedding and head (so it does for the plain model)
    run = Trainer(model=opt, args=arguments(tmp_path, max_steps=2, save_strategy="no"),
                  train_dataset=ShiftedTokens(4, VOCAB_SEED, vocab, SEQ + 1),
                  eval_dataset=ShiftedTokens(2, VOCAB_SEED + 1, vocab, SEQ + 1))
    run.train()
    assert len(logged(run.state.log_history, "loss")) == 2 and len(logged(run.state.log_history, "eval_loss")) == 1


def test_gradient_checkpointing_argument_is_picofxs_checkpoint_pass(tmp_path):
    model = tiny_model()
    opt = picofx.optimize(model, example_batch(model), passes=[], backend="eager")
    # transformers 5 renamed the argument (the old name still works, with a FutureWarning)
    renamed = "activation_checkpointing" in inspect.signature(TrainingArguments).parameters
    argument = {"activation_checkpointing" if renamed else "gradient_checkpointing": True}
    with pytest.raises(ValueError, match="picofx plans activation checkpointing"):
        trainer(opt, tmp_path, **argument).train()


# ---- training, evaluation, checkpoints ----------------------------------------------------------------

def test_trainer_trains_and_evaluates_like_the_plain_model(tmp_path):
    plain = trainer(tiny_model(), tmp_path / "plain", save_strategy="no")
    plain.train()
    model = tiny_model()
    opt = picofx.optimize(model, example_batch(model), passes=[], backend="eager")
    optimized = trainer(opt, tmp_path / "picofx", save_strategy="no")
    optimized.train()
    for key in ("loss", "eval_loss", "grad_norm"):
        expected = logged(plain.state.log_history, key)
        assert len(expected) >= 2
        torch.testing.assert_close(logged(optimized.state.log_history, key), expected, rtol=1e-5, atol=1e-6)
    for name, value in plain.model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)


PASSES_UNDER_TEST = lambda: ["fuse", "precision", picofx.passes.Checkpoint(budget=0.97)]  # noqa: E731


def test_save_resume_and_from_pretrained_with_fuse_precision_checkpoint(tmp_path):
    model = tiny_model()
    opt = picofx.optimize(model, example_batch(model), passes=PASSES_UNDER_TEST(), backend="eager")
    assert [r.name for r in opt.report.records] == ["fuse", "precision", "checkpoint"]
    opt.gradient_checkpointing_enable()  # accepted: the checkpoint pass plans the recomputation
    assert opt.is_activation_checkpointing
    whole = trainer(opt, tmp_path / "run")
    whole.train()
    history = whole.state.log_history
    assert len(logged(history, "eval_loss")) == 2 and len(logged(history, "loss")) == 4

    saved = LlamaForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-4")
    assert saved.state_dict().keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(saved.state_dict()[name], value, rtol=0, atol=0)

    fresh = tiny_model(seed=1)  # other weights: everything must come from the checkpoint
    resumed_opt = picofx.optimize(fresh, example_batch(fresh), passes=PASSES_UNDER_TEST(), backend="eager")
    resumed = trainer(resumed_opt, tmp_path / "run", eval_strategy="no")  # eval_loss checked above
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    again = resumed.state.log_history  # steps 1-2 restored from checkpoint-2's state, 3-4 trained again
    assert [e["step"] for e in again if "loss" in e] == [1, 2, 3, 4]
    torch.testing.assert_close(logged(again, "loss"), logged(history, "loss"), rtol=1e-6, atol=0)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_trainer_with_inductor(tmp_path):
    plain = trainer(tiny_model(), tmp_path / "plain", max_steps=2, eval_strategy="no", save_strategy="no")
    plain.train()
    model = tiny_model()
    opt = picofx.optimize(model, example_batch(model), passes=["fuse"], backend="inductor")
    optimized = trainer(opt, tmp_path / "picofx", max_steps=2, eval_strategy="no", save_strategy="no")
    optimized.train()
    torch.testing.assert_close(logged(optimized.state.log_history, "loss"),
                               logged(plain.state.log_history, "loss"), rtol=1e-4, atol=1e-5)


def test_the_example_trains_and_evaluates(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_hf_trainer", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--backend", "eager", "--steps", "2", "--batch", "2", "--seq", "32", "--passes", "fuse",
                           "--output-dir", str(tmp_path)])
    assert len(logged(result["history"], "loss")) == 2 and result["eval_loss"] < 6.0  # log(256) = 5.55 at start
    assert (tmp_path / "checkpoint-2" / "config.json").is_file()
    assert "fuse" in capsys.readouterr().out


def test_the_example_without_an_output_dir_writes_to_a_fresh_directory_it_prints(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("train_hf_trainer", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes its directories
    result = example.main(["--backend", "eager", "--steps", "1", "--batch", "2", "--seq", "32", "--passes"])
    made = Path(result["output_dir"])
    assert made.parent == tmp_path and made.name.startswith("picofx-hf-trainer-")
    assert (made / "checkpoint-1" / "config.json").is_file()
    assert f"checkpoints go to {made}" in capsys.readouterr().out


# ---- data parallel: two ranks under torchrun -------------------------------------------------------------

def variants() -> list[str]:
    return ["ddp", "overlap", "overlap-accumulate"] if "overlap" in PASSES else ["ddp"]


def stop(launcher: subprocess.Popen) -> None:
    """Ends torchrun and the ranks it started (each in a session of its own, so not in its group)."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    ranks = [int(pid) for pid in children.read_text().split()] if children.exists() else []
    launcher.terminate()  # torchrun passes it on to its ranks
    try:
        launcher.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_under_torchrun(tmp_path, names: list[str]) -> None:
    # faulthandler: a rank that dies of a signal (a SIGSEGV seen once in CI) prints every thread's stack
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1]),
           "PYTHONFAULTHANDLER": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, str(tmp_path), *names]
    ranks = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True, text=True)
    try:
        output, _ = ranks.communicate(timeout=RANKS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop(ranks)
        output, _ = ranks.communicate()
        pytest.fail(f"the ranks did not finish in {RANKS_TIMEOUT_S}s:\n{output[-4000:]}")
    assert ranks.returncode == 0, output[-4000:]


def test_two_ranks_under_torchrun_have_the_full_batch_gradients(tmp_path):
    names = variants()
    run_under_torchrun(tmp_path, names)
    for name in names:
        result = [torch.load(tmp_path / f"{name}-rank{r}.pt") for r in range(2)]
        assert result[0]["wrapped"] == ("DistributedDataParallel" if name == "ddp" else "OptimizedLlamaForCausalLM")
        assert ("a second time" in result[0]["refused"]) == (name == "overlap")
        ids = torch.cat([r["input_ids"] for r in result])  # (4, SEQ): the step's global batch
        reference = tiny_model()
        reference(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # Trainer's default max_grad_norm
        for param_name, param in reference.named_parameters():
            for r in result:
                torch.testing.assert_close(r["grads"][param_name], param.grad, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=param_name, v=name: f"{v} {n}: {m}")


def test_shard_under_torchrun_trains_like_ddp_and_saves_what_the_plain_model_loads(tmp_path):
    """passes=["shard"] under Trainer on 2 ranks: DTensor parameters, no DDP around them, the same
    logged losses and final weights as Trainer's own DDP run of the plain model; the checkpoint
    Trainer saves (save_only_model) loads into the plain model with from_pretrained."""
    run_under_torchrun(tmp_path, ["ddp-steps", "shard-steps", "example-fuse", "example-fuse-shard"])
    ddp, sharded = (torch.load(tmp_path / f"{name}-rank0.pt") for name in ("ddp-steps", "shard-steps"))
    assert sharded["wrapped"] == "OptimizedLlamaForCausalLM" and sharded["dtensors"]
    assert len(ddp["losses"]) == 3
    torch.testing.assert_close(sharded["losses"], ddp["losses"], rtol=1e-4, atol=0)
    saved = LlamaForCausalLM.from_pretrained(tmp_path / "shard-steps" / "checkpoint-3")
    assert saved.state_dict().keys() == ddp["state"].keys()
    for name, value in ddp["state"].items():
        torch.testing.assert_close(saved.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # the example, `torchrun --nproc-per-node 2 examples/train_hf_trainer.py --passes fuse shard`
    plain, example = (torch.load(tmp_path / f"{name}-rank0.pt") for name in ("example-fuse", "example-fuse-shard"))
    assert len(plain["losses"]) == 2 and len(plain["eval_losses"]) == 3  # steps 1, 2 and the final evaluate
    for key in ("losses", "eval_losses"):
        torch.testing.assert_close(example[key], plain[key], rtol=1e-4, atol=0)
    saved = LlamaForCausalLM.from_pretrained(Path(example["output_dir"]) / "checkpoint-2")
    assert saved.state_dict().keys() == plain["state"].keys()
    for name, value in plain["state"].items():
        torch.testing.assert_close(saved.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


class RecordStep(TrainerCallback):
    """Keeps the gradients Trainer is about to step with."""

    def __init__(self):
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def rank_main(out_dir: str, names: list[str]) -> None:
    import torch.distributed as dist

    for name in names:
        if name.endswith("-steps"):
            train_steps(out_dir, name)
            continue
        if name.startswith("example-"):
            run_example(out_dir, name)
            continue
        # TrainingArguments sets up the process group, which the overlap pass needs at optimize
        # accumulate: two micro-batches of one row per rank, the first under opt.no_sync()
        micro = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2) if "accumulate" in name else {}
        args = arguments(out_dir, max_steps=1, save_strategy="no", eval_strategy="no", ddp_timeout=120, **micro)
        model = tiny_model()
        passes = [picofx.passes.Overlap()] if name.startswith("overlap") else []
        opt = picofx.optimize(model, example_batch(model, args.per_device_train_batch_size), passes=passes,
                              backend="eager")
        batches, record = [], RecordStep()

        def collate(rows, batches=batches):
            batch = transformers.default_data_collator(rows)
            batches.append(batch["input_ids"])
            return batch

        run = Trainer(model=opt, args=args, train_dataset=Tokens(8, VOCAB_SEED, model.config.vocab_size),
                      data_collator=collate, callbacks=[record])
        run.train()
        steps = args.gradient_accumulation_steps
        refused = ""
        if name == "overlap":  # wrapped by hand, the module refuses a second all-reduce
            try:
                torch.nn.parallel.DistributedDataParallel(opt)(**example_batch(model))
            except RuntimeError as e:
                refused = str(e)
        torch.save({"input_ids": torch.cat(batches[:steps]), "grads": record.grads, "refused": refused,
                    "wrapped": type(run.model_wrapped).__name__},
                   Path(out_dir) / f"{name}-rank{dist.get_rank()}.pt")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # a rank can hang in interpreter shutdown after the group is gone


def train_steps(out_dir: str, name: str) -> None:
    """Three steps of Trainer, the plain model under its DDP ("ddp-steps") or optimized with pass
    shard ("shard-steps", checkpoint at the last step); the logged losses and the final weights."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    args = arguments(Path(out_dir) / name, max_steps=3, save_strategy="steps", save_steps=3, save_only_model=True,
                     eval_strategy="no", ddp_timeout=120)
    model = tiny_model()
    opt = model if name.startswith("ddp") else picofx.optimize(model, example_batch(model), passes=["shard"],
                                                              backend="eager")
    run = Trainer(model=opt, args=args, train_dataset=Tokens(12, VOCAB_SEED, model.config.vocab_size))
    run.train()
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v.detach() for k, v in model.state_dict().items()}
    torch.save({"losses": torch.tensor(logged(run.state.log_history, "loss")), "state": state,
                "wrapped": type(run.model_wrapped).__name__,
                "dtensors": all(isinstance(p, DTensor) for p in model.parameters())},
               Path(out_dir) / f"{name}-rank{dist.get_rank()}.pt")


def run_example(out_dir: str, name: str) -> None:
    """examples/train_hf_trainer.py on this rank, two steps with the passes the name lists
    ("example-fuse-shard": fuse, shard); its losses, checkpoint directory and final weights."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    spec = importlib.util.spec_from_file_location("train_hf_trainer", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    passes = name.split("-")[1:]
    result = example.main(["--backend", "eager", "--steps", "2", "--batch", "2", "--seq", "32",
                           "--output-dir", str(Path(out_dir) / name), "--passes", *passes])
    model = result["model"]
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v.detach() for k, v in model.state_dict().items()}
    torch.save({"losses": torch.tensor(logged(result["history"], "loss")), "state": state,
                "eval_losses": torch.tensor(logged(result["history"], "eval_loss")), "output_dir": result["output_dir"]},
               Path(out_dir) / f"{name}-rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2:])
