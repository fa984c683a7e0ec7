"""Saving under float8: picofx train's checkpoint (DCP) holds the fp32 master weights under the
model's own names, and `picofx export` of it loads in transformers with the trained model's logits."""
import dataclasses
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from picofx.cli import main as picofx_main
from picofx.cli import train, train_state
from picofx.cli.train_args import parse_args, run_options
from picofx.cli.train_state import single_process_quiet
from picofx.models.llama import CONFIGS, Llama
from picofx.runtime.checkpoints import AsyncSaver

transformers = pytest.importorskip("transformers")
FLOAT8_RUN = ["--backend", "eager", "--passes", "--float8", "tensorwise", "--float8-layers", "all",
              "--batch", "4", "--seq", "16", "--steps", "1", "--no-measure-cuts"]


def one_float8_step_saved(directory) -> tuple[dict, dict]:
    """One step of picofx train with float8 linears, saved as picofx train saves it; returns the
    trained parameters and the precision pass's notes."""
    args = parse_args(FLOAT8_RUN, environ={})
    ranks = train.Ranks(args)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Precision\(float8=...\) on the CPU")
        s = train.setup(args, ranks)
        s.opt_model.forward_backward(**s.first)
    s.optimizer.step()
    saver = AsyncSaver(str(directory), group=ranks.agreement, rank=0)
    state = train_state.run_state(s.opt_model, s.optimizer, s.schedule, s.batches, step=1, replica=ranks.replica)
    with single_process_quiet():
        saver.save({**state, "options": run_options(args, ranks.layout)}, 1)
        saver.wait()
    trained = {n: p.detach().clone() for n, p in train_state.trained_module(s.opt_model).named_parameters()}
    notes = next(r.notes for r in s.opt_model.report.records if r.name == "precision")
    ranks.close()
    return trained, notes


def test_a_float8_run_saves_and_exports_its_high_precision_weights(tmp_path):
    trained, notes = one_float8_step_saved(tmp_path / "run")
    assert notes["float8_linears"] == 15  # every linear layer ran in float8: the saving below is under float8
    saved = dcp.FileSystemReader(str(tmp_path / "run" / "step-1")).read_metadata().state_dict_metadata
    weights = {k[len("model."):]: v for k, v in saved.items()
               if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    assert weights.keys() == trained.keys()
    assert {v.properties.dtype for v in weights.values()} == {torch.float32}
    assert all(tuple(weights[n].size) == tuple(p.shape) for n, p in trained.items())

    assert picofx_main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    model = Llama(dataclasses.replace(CONFIGS["tiny"], vocab_size=hf.config.vocab_size))
    model.load_state_dict(trained)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert hf.dtype == torch.float32
        torch.testing.assert_close(hf(tokens).logits, model.eval()(tokens), rtol=1e-5, atol=1e-6)
