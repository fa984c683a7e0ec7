"""picofx export: a picofx train checkpoint of any layout becomes a folder that transformers'
AutoModelForCausalLM.from_pretrained loads, whose logits equal the trained model's."""
import dataclasses
import os
import pathlib
import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from picofx.cli import main as picofx_main
from picofx.cli.export import ExportError, checkpoint_directory, export
from picofx.cli.train_state import single_process_quiet
from picofx.models.hf_export import reference_to_hf
from picofx.models.llama import CONFIGS, Llama

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "passes"))  # the rank harness, beside the pass tests
from spawn_ranks import run_ranks  # noqa: E402

transformers = pytest.importorskip("transformers")
FAST = ["--backend", "eager", "--passes", "--batch", "4", "--seq", "16", "--log-every", "1",
        "--microbatches", "2", "--no-measure-cuts"]
TINY = dataclasses.replace(CONFIGS["tiny"], vocab_size=256)  # as picofx train builds it


def tokens(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


def assert_same_logits(model: torch.nn.Module, folder) -> None:
    """The exported folder, loaded by transformers, gives `model`'s logits (fp32, rtol 1e-5)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens()).logits, model.eval()(tokens()), rtol=1e-5, atol=1e-6)


def random_reference(seed: int = 0, tie: bool = False) -> Llama:
    """The tiny reference LLaMA with norms that are not all ones (a swapped norm would show)."""
    torch.manual_seed(seed)
    model = Llama(TINY)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    if tie:
        model.final_proj.weight = model.embedding.weight
    return model


def save_like_picofx_train(directory, weights: dict, options: dict) -> None:
    with single_process_quiet():
        dcp.save({"model": weights, "options": options}, checkpoint_id=str(directory), no_dist=True)


@pytest.mark.parametrize("tie", [False, True], ids=["separate-head", "tied-head"])
def test_the_reference_llama_renamed_is_llama_for_causal_lm(tie):
    """The mapping alone: the same weights under LlamaForCausalLM's names give the same logits
    (RoPE as rotate-half in both, so q and k go over unpermuted)."""
    model = random_reference(tie=tie)
    weights, config = reference_to_hf(dict(model.state_dict()), TINY)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.load_state_dict(weights, strict=not tie)  # tied: the head is the embedding, written once
    assert config.tie_word_embeddings == tie and ("lm_head.weight" in weights) != tie
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens()).logits, model.eval()(tokens()), rtol=1e-5, atol=1e-6)


def trained_and_saved(rank: int, world: int, layouts: list, root: str) -> dict:
    """Per layout: two steps of picofx train's own setup, saved as picofx train saves (ROOT/step-2);
    returns the trained parameters, whole (shards and tensor-parallel pieces joined, stages gathered)."""
    import torch.distributed as dist

    from picofx.cli import train, train_state
    from picofx.cli.train_args import parse_args, run_options
    from picofx.runtime.checkpoints import AsyncSaver

    environ = {"RANK": str(rank), "WORLD_SIZE": str(world)} if world > 1 else {}
    os.environ.update(environ)
    trained = {}
    for layout in layouts:
        directory = os.path.join(root, "-".join(a.strip("-") for a in layout if a.startswith("--")) or "one-process")
        args = parse_args([*FAST, *layout, "--steps", "2"], environ=environ)
        ranks = train.Ranks(args)
        s = train.setup(args, ranks)
        for step in range(2):
            s.opt_model.forward_backward(**(s.first if step == 0 else s.batches.sample()))
            s.optimizer.step()
            s.optimizer.zero_grad(set_to_none=True)
        saver = AsyncSaver(directory, group=ranks.agreement, rank=rank)
        state = train_state.run_state(s.opt_model, s.optimizer, s.schedule, s.batches, step=2, replica=ranks.replica)
        with single_process_quiet():
            saver.save({**state, "options": run_options(args, ranks.layout)}, 2)
            saver.wait()
        whole = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                 for n, p in train_state.trained_module(s.opt_model).named_parameters()}
        if world > 1:  # a pipeline rank holds its stages' parameters only
            pieces = [None] * world
            dist.all_gather_object(pieces, whole)
            whole = {n: t for piece in pieces for n, t in piece.items()}
        ranks.close()
        trained[directory] = whole
    return trained


def assert_exports_equal_trained(trained: dict, tmp_path) -> None:
    for directory, whole in trained.items():
        model = Llama(TINY)
        model.load_state_dict(whole)
        out = tmp_path / f"{pathlib.Path(directory).name}-hf"
        assert picofx_main(["export", directory, "--hf", str(out)]) == 0
        assert_same_logits(model, out)


def test_export_of_a_one_process_run(tmp_path):
    assert_exports_equal_trained(trained_and_saved(0, 1, [[]], str(tmp_path)), tmp_path)


def test_export_of_sharded_and_tensor_parallel_runs(tmp_path):
    results = run_ranks(trained_and_saved, 2, [["--shard"], ["--tp", "2"]], str(tmp_path), timeout=400,
                        collective_timeout=120)
    assert results[0].keys() == results[1].keys()
    assert_exports_equal_trained(results[0], tmp_path)


@pytest.mark.slow
def test_export_of_pipelined_and_sequence_parallel_runs(tmp_path):
    results = run_ranks(trained_and_saved, 2, [["--pp", "2"], ["--tp", "2", "--sequence-parallel"]], str(tmp_path),
                        timeout=500, collective_timeout=120)
    assert_exports_equal_trained(results[0], tmp_path)


def test_a_hugging_face_model_goes_out_under_its_own_names_with_its_tied_head(tmp_path):
    """A checkpoint of a Hugging Face model (picofx train --model DIR records DIR): its config and
    tokenizer files are the model folder's, its weights its own, the tied head written once."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    source = tmp_path / "tiny-llama"
    config.dtype = torch.bfloat16  # as a pretrained model's config names it; these weights are fp32
    config.save_pretrained(str(source))
    (source / "tokenizer.json").write_text('{"model": {"type": "WordLevel"}}')
    weights = {f"wrapped.{n}": t for n, t in model.state_dict().items()}  # under a training wrapper's prefix
    save_like_picofx_train(tmp_path / "run", weights, {"model": str(source), "size": "tiny"})
    assert export(str(tmp_path / "run"), str(tmp_path / "out")) == tmp_path / "run"
    out = tmp_path / "out"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    assert (out / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
    assert transformers.AutoConfig.from_pretrained(str(out)).dtype == torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens()).logits, model(tokens()).logits, rtol=1e-5, atol=1e-6)


def tiny_hf_llama_folder(root: pathlib.Path) -> pathlib.Path:
    """A Llama config with a tied head and a word-level tokenizer, saved as a model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([CORPUS], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                     eos_token="</s>")
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                                      tie_word_embeddings=True)
    folder = root / "tiny-llama"
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


CORPUS = "\n".join(" ".join(w for w in "a slow river carries old leaves past green hills".split()[i:] + ["."])
                   for i in range(8)) * 40


def model_run(tmp_path) -> tuple[pathlib.Path, list]:
    """A Hugging Face model folder and the picofx train options that train it on a small corpus."""
    folder = tiny_hf_llama_folder(tmp_path)
    (tmp_path / "corpus.txt").write_text(CORPUS)
    return folder, ["--model", str(folder), "--data", str(tmp_path / "corpus.txt"),
                    "--data-cache", str(tmp_path / "tokens")]


def assert_model_exports_equal_trained(folder: pathlib.Path, trained: dict, tmp_path) -> None:
    """Each checkpoint of a --model run exports as the trained Hugging Face model, its tied head
    once, with the folder's tokenizer."""
    config = transformers.AutoConfig.from_pretrained(folder)
    for directory, whole in trained.items():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        assert set(model.load_state_dict(whole, strict=False).missing_keys) <= {"lm_head.weight"}  # tied
        out = tmp_path / f"{pathlib.Path(directory).name}-hf"
        assert picofx_main(["export", directory, "--hf", str(out)]) == 0
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        ids = transformers.AutoTokenizer.from_pretrained(str(out))(["old leaves past green hills ."],
                                                                 return_tensors="pt")["input_ids"]
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)


def test_export_of_a_picofx_train_model_run(tmp_path):
    folder, run = model_run(tmp_path)
    assert_model_exports_equal_trained(folder, trained_and_saved(0, 1, [run], str(tmp_path)), tmp_path)


@pytest.mark.slow
def test_export_of_sharded_and_pipelined_model_runs(tmp_path):
    folder, run = model_run(tmp_path)
    results = run_ranks(trained_and_saved, 2, [[*run, "--shard"], [*run, "--pp", "2"]], str(tmp_path),
                        timeout=500, collective_timeout=120)
    assert_model_exports_equal_trained(folder, results[0], tmp_path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("saved") / "run"
    save_like_picofx_train(directory, dict(random_reference().state_dict()), {"size": "tiny", "max_positions": "None"})
    return directory


def one_error_line(argv, capsys) -> str:
    assert picofx_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("picofx export: error: "), err
    return err


def test_bad_checkpoints_and_outputs_are_one_line_with_what_to_do(saved, tmp_path, capsys):
    assert "no such directory" in one_error_line(["export", str(tmp_path / "nowhere"), "--hf", str(tmp_path / "o")],
                                                 capsys)
    (tmp_path / "empty").mkdir()
    assert "no checkpoint there" in one_error_line(["export", str(tmp_path / "empty"), "--hf", str(tmp_path / "o")],
                                                   capsys)
    cut = tmp_path / "cut"
    shutil.copytree(saved, cut)
    next(cut.glob("*.distcp")).unlink()  # a rank's file never written
    assert "is incomplete" in one_error_line(["export", str(cut), "--hf", str(tmp_path / "o")], capsys)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")
    assert "not an empty directory" in one_error_line(["export", str(saved), "--hf", str(tmp_path / "taken")], capsys)
    assert not (tmp_path / "o").exists()


def test_a_model_without_a_mapping_is_refused(tmp_path, capsys):
    from picofx.models.gpt2 import GPT2, GPT2Config

    save_like_picofx_train(tmp_path / "gpt2", dict(GPT2(GPT2Config()).state_dict()), {"size": "tiny"})
    err = one_error_line(["export", str(tmp_path / "gpt2"), "--hf", str(tmp_path / "o")], capsys)
    assert "not the reference LLaMA's" in err and "picofx train --model" in err


def test_a_save_directory_exports_its_newest_complete_step(saved, tmp_path):
    from picofx.runtime.checkpoints import COMPLETE

    for step in (2, 10, 30):
        shutil.copytree(saved, tmp_path / f"step-{step}")
        if step < 30:  # step-30's write is still going on: it has no marker yet
            (tmp_path / f"step-{step}" / COMPLETE).write_text(f"{step}\n")
    assert checkpoint_directory(tmp_path) == tmp_path / "step-10"
    assert checkpoint_directory(tmp_path / "step-2") == tmp_path / "step-2"
    with pytest.raises(ExportError, match="step-30 is incomplete"):
        checkpoint_directory(tmp_path / "step-30")
