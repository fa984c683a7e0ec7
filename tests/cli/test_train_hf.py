"""picofx train --model: a Hugging Face causal LM (a tiny Llama, a tiny Qwen2) built from a local
directory's config, randomly initialised or from its weights (--init-from-hf), on its own tokenizer
(trained here, saved as a PreTrainedTokenizerFast folder). The first step's loss is the model's own
Hugging Face loss on the same batch; the data is tokenized once into a token file that a later run
maps; the windows are contiguous pieces of the documents' token stream, each document ended by EOS;
batches prepared by DataLoader workers are those drawn one at a time, and a resumed run goes on bit
for bit. On 2 ranks (--shard; --tp and --pp among the slow tests) the first loss is the model's own
and the parameters keep the model's names."""
import dataclasses
import importlib
import os
import pathlib
import random
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from picofx.cli import train  # noqa: E402
from picofx.cli.train_args import parse_args  # noqa: E402
from picofx.cli.train_data import Batches, DataError, documents, tokenized  # noqa: E402
from picofx.data import token_file  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "passes"))  # the rank harness, beside the pass tests
from spawn_ranks import run_ranks  # noqa: E402

WORDS = ("the quick brown fox jumps over lazy dog while seven wise owls watch a slow river carry "
         "old leaves past green hills and small stone bridges under grey clouds").split()
FAST = ["--backend", "eager", "--batch", "2", "--seq", "16", "--log-every", "1"]


def corpus_text(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + "." for _ in range(sentences))


def tiny_tokenizer():
    """A word-level tokenizer of WORDS that starts each text with <s> (as Llama's does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([corpus_text(0, 200)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def model_dir(root: pathlib.Path, kind: str) -> pathlib.Path:
    tokenizer = tiny_tokenizer()
    fields = dict(vocab_size=len(tokenizer) + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config = transformers.LlamaConfig(**fields) if kind == "llama" else transformers.Qwen2Config(**fields)
    directory = root / kind
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text(1, 400))
    return {"llama": model_dir(root, "llama"), "qwen2": model_dir(root, "qwen2"), "corpus": corpus,
            "cache": root / "tokens"}


def first_batch(files, directory, seed: int = 0) -> dict:
    """The batch picofx train's first step trains on: the first draw of the run's sampler, on the
    tokens of the tokenizer transformers loads from the model's directory (for a Qwen2 model, a
    Qwen2Tokenizer over the saved tokenizer files)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    found, _ = tokenized(str(files["corpus"]), tokenizer, str(files["cache"]))
    return Batches(found.tokens(), 2, 16, seed).sample()


def hf_own_loss(model, batch: dict) -> torch.Tensor:
    """The model's own loss (it shifts the labels itself) on the batch's windows of seq + 1 tokens."""
    windows = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
    with torch.no_grad():
        return model.train()(input_ids=windows, labels=windows).loss


def random_model(directory, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(directory)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def test_documents_are_packed_into_one_stream_each_ended_by_eos(files, tmp_path):
    tokenizer = tiny_tokenizer()
    docs = [["the quick fox."], ["seven owls\n", "watch a river."]]  # the second in two pieces, as a long file is
    found = token_file(tokenizer, docs, data_key="two documents", cache=tmp_path)
    eos = tokenizer.eos_token_id
    expected = (tokenizer("the quick fox.")["input_ids"] + [eos] + tokenizer("seven owls\n")["input_ids"] +
                tokenizer("watch a river.", add_special_tokens=False)["input_ids"] + [eos])
    assert found.array().tolist() == expected and expected.count(tokenizer.bos_token_id) == 2
    assert found.dtype == "uint16" and found.tokenized_seconds is not None

    corpus, _ = tokenized(str(files["corpus"]), tokenizer, str(tmp_path))
    stream = corpus.array().astype(np.int64)
    assert stream.tolist() == tokenizer(files["corpus"].read_text())["input_ids"] + [eos]
    batches = Batches(corpus.tokens(), 8, 16, seed=3)
    spans = np.lib.stride_tricks.sliding_window_view(stream, 17)
    for split in ("train", "val"):
        batch = batches.sample(split)
        assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
        for row in torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1).numpy():
            assert (spans == row).all(axis=1).any(), row  # a contiguous piece of the stream


def test_a_saved_dataset_trains_each_row_a_document(files, tmp_path, capsys):
    """--data DIR written by datasets' save_to_disk (the datasets package is in picofx[hf])."""
    datasets = pytest.importorskip("datasets")
    rows = files["corpus"].read_text().splitlines()
    datasets.Dataset.from_dict({"id": list(range(len(rows))), "text": rows}).save_to_disk(str(tmp_path / "rows"))
    tokenizer = tiny_tokenizer()
    found, line = tokenized(str(tmp_path / "rows"), tokenizer, str(tmp_path / "tokens"))
    eos = tokenizer.eos_token_id
    assert found.array().tolist() == [t for row in rows for t in tokenizer(row)["input_ids"] + [eos]], line
    result = train.main([*FAST, "--model", str(files["llama"]), "--data", str(tmp_path / "rows"), "--data-cache",
                         str(tmp_path / "tokens"), "--steps", "1"])
    assert "mapped, tokenized by an earlier run" in capsys.readouterr().out and np.isfinite(result["losses"][0])

    datasets.Dataset.from_dict({"body": rows}).save_to_disk(str(tmp_path / "untitled"))
    with pytest.raises(DataError, match="no text column .* it has body"):
        tokenized(str(tmp_path / "untitled"), tokenizer, str(tmp_path / "tokens"))


def test_a_dataset_name_is_loaded_from_the_hub_and_its_failure_is_one_line(files, tmp_path, monkeypatch):
    """A --data that is neither a file nor a directory is a Hugging Face dataset name: its train split
    (there is no network here, so the hub's answer is a Dataset made in the test); offline, the load
    fails with one line naming the source."""
    datasets = pytest.importorskip("datasets")
    rows = files["corpus"].read_text().splitlines()
    real_load = datasets.load_dataset
    asked = []

    def from_the_hub(name, split=None, **options):
        asked.append((name, split))
        return datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": rows})})[split]

    monkeypatch.setattr(datasets, "load_dataset", from_the_hub)
    tokenizer = tiny_tokenizer()
    found, _ = tokenized("someone/stories", tokenizer, str(tmp_path / "tokens"))
    assert asked == [("someone/stories", "train")]
    assert found.array().tolist() == [t for row in rows for t in tokenizer(row)["input_ids"] + [tokenizer.eos_token_id]]

    monkeypatch.setattr(datasets, "load_dataset", real_load)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(DataError, match=r"^--data nobody/no-such-dataset: datasets could not load it \(\w+") as failed:
        tokenized("nobody/no-such-dataset", tokenizer, str(tmp_path / "other-tokens"))
    assert "\n" not in str(failed.value)


def same(batch: dict, expected: dict) -> bool:
    return batch.keys() == expected.keys() and all(torch.equal(batch[k], expected[k]) for k in batch)


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_prepared_ahead_are_those_drawn_one_at_a_time(workers, files):
    found, _ = tokenized(str(files["corpus"]), tiny_tokenizer(), str(files["cache"]))
    drawn, ahead = Batches(found.tokens(), 4, 16, seed=5), Batches(found.tokens(), 4, 16, seed=5)
    expected = [drawn.sample() for _ in range(6)]
    ahead.prefetch("cpu", workers)
    for i in range(4):
        assert same(ahead.next(), expected[i])
    saved = ahead.state_dict()  # the position after 4 handed out, though the workers drew further
    resumed = Batches(found.tokens(), 4, 16, seed=0)
    resumed.load_state_dict(saved)
    assert same(resumed.sample(), expected[4])
    assert same(ahead.sample(), expected[4])  # sample stops the workers and draws from the same position
    assert ahead.handed_out == 4 and "4.00" not in ahead.wait_line(1.0, 4)


def test_trains_a_hugging_face_llama_on_its_tokenizer_and_resumes_bit_for_bit(files, tmp_path, capsys):
    common = [*FAST, "--model", str(files["llama"]), "--data", str(files["corpus"]), "--data-cache",
              str(tmp_path / "tokens")]
    straight = train.main([*common, "--steps", "4"])
    out = capsys.readouterr().out
    assert re.search(r"data: [\d,]+ tokens of .*corpus.txt, tokenized in", out), out
    assert re.search(r"data: a step waited [\d.]+ ms for its batch, [\d.]+% of the run \(1 worker", out), out
    (stream,) = (tmp_path / "tokens").glob("*.bin")
    written = stream.stat().st_mtime_ns

    expected = hf_own_loss(random_model(files["llama"]), first_batch(files, files["llama"]))
    torch.testing.assert_close(torch.tensor(straight["losses"][0]), expected, rtol=1e-5, atol=0)
    assert len(set(straight["losses"])) == 4

    first = train.main([*common, "--steps", "2", "--save", str(tmp_path / "run")])
    resumed = train.main([*common, "--steps", "4", "--resume", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert out.count("mapped, tokenized by an earlier run") == 2 and "tokenized in" not in out, out
    assert stream.stat().st_mtime_ns == written and len(list((tmp_path / "tokens").glob("*.bin"))) == 1
    assert first["losses"] + resumed["losses"] == straight["losses"]


def test_init_from_hf_starts_from_the_saved_weights_of_a_qwen2(files, tmp_path, capsys):
    directory = tmp_path / "pretrained"
    pretrained = random_model(files["qwen2"], seed=123)
    pretrained.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    args = [*FAST, "--data", str(files["corpus"]), "--data-cache", str(files["cache"]), "--steps", "1"]
    loaded = train.main([*args, "--model", str(directory), "--init-from-hf"])
    batch = first_batch(files, directory)
    torch.testing.assert_close(torch.tensor(loaded["losses"][0]), hf_own_loss(pretrained, batch), rtol=1e-5, atol=0)
    assert loaded["losses"][0] != pytest.approx(hf_own_loss(random_model(directory), batch).item(), rel=1e-3)


@pytest.mark.parametrize("options, message", [
    (["--init-from-hf"], "--init-from-hf loads a Hugging Face model's weights: give the model with --model DIR"),
    (["--model", "{missing}"], "a directory without a readable config.json"),
    (["--model", "{llama}", "--init-from-hf", "--seq", "16"], "holds no weights (no .safetensors or pytorch_model.bin file)"),
    (["--model", "{llama}", "--seq", "65"], "--seq 65 is longer than"),
])
def test_bad_model_options_stop_with_one_line(options, message, files, tmp_path, capsys):
    (tmp_path / "missing").mkdir()
    given = [o.format(missing=tmp_path / "missing", llama=files["llama"]) for o in options]
    with pytest.raises(SystemExit) as stopped:
        parse_args(given, environ={})
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def resized(files, root: pathlib.Path, **fields) -> pathlib.Path:
    """The tiny Llama's directory with other shapes in its config (the tokenizer kept)."""
    config = transformers.AutoConfig.from_pretrained(files["llama"])
    for name, value in fields.items():
        setattr(config, name, value)
    directory = root / "resized"
    config.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def test_the_device_fit_check_and_the_plan_take_the_models_own_shape(files, tmp_path, capsys, monkeypatch):
    from picofx.cli import train_layout
    from picofx.cli.train_parser import step_bytes
    from picofx.cli.train_model import planned_shape
    from picofx.planner.layouts import Layout

    huge = resized(files, tmp_path, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                   num_attention_heads=128, num_key_value_heads=8)
    with pytest.raises(SystemExit) as stopped:  # --size tiny fits anywhere; this model's step does not fit 17 GB
        parse_args(["--model", str(huge), "--seq", "16"], environ={})
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"--model {huge} needs about " in err and "pick a smaller model" in err, err

    args = parse_args(["--model", str(files["llama"]), "--layout", "auto", "--seq", "16"],
                      environ={"RANK": "0", "WORLD_SIZE": "2"})
    shape, tied = planned_shape(args)
    config = transformers.AutoConfig.from_pretrained(files["llama"])
    assert (shape.vocab_size, shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers,
            shape.num_attention_heads, shape.num_key_value_heads) == (
        config.vocab_size, 32, 64, 2, 4, 2) and not tied
    planned = []
    monkeypatch.setattr("picofx.cost.device.calibrate_link", lambda _: None)
    monkeypatch.setattr("torch.distributed.broadcast_object_list", lambda *_, **__: None)  # rank 0's own choice
    monkeypatch.setattr(train_layout, "planned_choice", lambda args, config, link: planned.append(config) or (
        Layout(dp=2, tp=1, pp=1), "layout auto: dp2"))
    assert train_layout.choose_layout(args, 0) == (Layout(dp=2), "layout auto: dp2") and planned == [shape]

    tied_model = resized(files, tmp_path / "tied", tie_word_embeddings=True)
    shape, tied = planned_shape(parse_args(["--model", str(tied_model), "--seq", "16"], environ={}))
    assert tied and step_bytes(shape, 2, 16) - step_bytes(shape, 2, 16, tied) == 16 * shape.vocab_size * 32


def first_step(rank: int, world: int, files: dict, layout: list, cache: str) -> dict:
    """picofx train's setup under `layout` on this rank, and its first step's loss; how many times
    this rank tokenized the data (slowly: ranks that tokenized at once would both do it)."""
    from torch.distributed.tensor import DTensor

    tokens = importlib.import_module("picofx.data.tokens")
    tokenizing, calls = tokens.token_ids, []

    def slowly(*args, **kwargs):
        calls.append(rank)
        time.sleep(1.0)
        yield from tokenizing(*args, **kwargs)
    tokens.token_ids = slowly
    run = importlib.import_module("picofx.cli.train")
    environ = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    os.environ.update(environ)
    args = parse_args([*FAST, "--model", str(files["llama"]), "--data", str(files["corpus"]), "--data-cache",
                       cache, "--microbatches", "2", "--no-measure-cuts", *layout], environ=environ)
    ranks = run.Ranks(args)
    s = run.setup(args, ranks)
    loss = s.opt_model.forward_backward(**s.first).item()
    dtensors = {n: isinstance(p, DTensor) for n, p in s.opt_model.named_parameters()}
    ranks.close()
    return {"loss": loss, "dtensors": dtensors, "replica": ranks.replica, "tokenized": len(calls)}


@pytest.mark.parametrize("layout", [pytest.param(["--shard"], id="shard"),
                                    pytest.param(["--tp", "2"], id="tp", marks=pytest.mark.slow),
                                    pytest.param(["--pp", "2"], id="pp", marks=pytest.mark.slow)])
def test_a_hugging_face_model_trains_on_two_ranks(layout, files, tmp_path):
    results = run_ranks(first_step, 2, files, layout, str(tmp_path / "tokens"), timeout=400, collective_timeout=120)
    assert sum(r["tokenized"] for r in results) == 1, results  # one rank tokenized, the other mapped its file
    model = random_model(files["llama"])
    names = [n for n, _ in model.named_parameters()]
    for result in results:  # each replica on its own batches, the first drawn at seed + replica
        expected = hf_own_loss(model, first_batch(files, files["llama"], result["replica"]))
        torch.testing.assert_close(torch.tensor(result["loss"]), expected, rtol=1e-5, atol=0)
        held = list(result["dtensors"])  # a pipeline rank: its stage's parameters, under the model's names
        assert held == [n for n in names if n in held] and held, held
        if layout[0] != "--pp":  # sharded, or tensor-parallel pieces (norms replicated): DTensors all
            assert held == names and all(result["dtensors"].values()), result["dtensors"]


def test_the_first_ranks_tokens_or_error_are_every_ranks_on_its_machine(monkeypatch):
    """The machine's other ranks never tokenize: they take the first rank's token file, or its
    error (and so never wait for a file that will not come)."""
    import torch.distributed as dist

    from picofx.cli.train_data import DataError
    from picofx.parallel import launch

    store = dist.HashStore()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(launch, "rendezvous_store", lambda: store)
    monkeypatch.setattr(launch, "_once_calls", {})

    def other_rank(name: str):
        launch._once_calls.clear()  # the same call, made in the other rank's process
        return launch.once_per_machine(lambda: pytest.fail("the other rank tokenized too"), name)

    assert launch.once_per_machine(lambda: "tokens.bin", "tokens a") == "tokens.bin"
    assert other_rank("tokens a") == "tokens.bin"

    def no_text_column():
        raise DataError("--data rows: no text column")
    for take in (lambda: launch.once_per_machine(no_text_column, "tokens b"), lambda: other_rank("tokens b")):
        with pytest.raises(DataError, match="no text column"):
            take()


@pytest.mark.slow
def test_layout_auto_plans_a_hugging_face_model_and_every_rank_trains_with_it(files, tmp_path):
    """Under torchrun (the planner measures in processes of its own, which spawned ranks cannot start)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "picofx",
               "train", *FAST, "--batch", "4", "--steps", "4", "--model", str(files["llama"]), "--data",
               str(files["corpus"]), "--data-cache", str(tmp_path / "tokens"), "--layout", "auto", "--no-measure-cuts"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PICOFX_CACHE": "0", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    chosen = re.search(r"^layout auto: dp(\d+)( shard)? x tp(\d+)( sp)? x pp(\d+)", done.stdout, re.M)
    assert chosen and int(chosen[1]) * int(chosen[3]) * int(chosen[5]) == 2, done.stdout[-3000:]
    assert f"{files['llama']} model, 4 steps" in done.stdout and "summary:" in done.stdout, done.stdout[-3000:]
