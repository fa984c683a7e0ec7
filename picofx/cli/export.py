"""The `picofx export` command: a checkpoint of picofx train as a folder Hugging Face's
`AutoModelForCausalLM.from_pretrained` loads (safetensors weights, config.json, generation_config.json,
and the model's tokenizer files where it has them).

Any layout's checkpoint: torch.distributed.checkpoint keeps each parameter under the model's own
name with its whole shape, whichever ranks held which pieces (replicas, shards, tensor-parallel
pieces, pipeline stages), and reads them back whole in this one process without a process group.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from picofx.cli.train_state import single_process_quiet
from picofx.models.hf_export import NoMapping, hf_to_hf, is_reference_llama, reference_to_hf
from picofx.models.llama import CONFIGS
from picofx.runtime.checkpoints import COMPLETE, INCOMPLETE, MISSING, find_checkpoint

MODEL_KEY = "model."  # picofx train saves the parameters under "model", each by its own name
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")
SHARD_SIZE = "5GB"  # safetensors files no larger than this, as save_pretrained writes them


class ExportError(ValueError):
    """What to fix before an export can be written: one line."""


def add_export_parser(commands) -> None:
    p = commands.add_parser(
        "export", help="write a picofx train checkpoint as a Hugging Face model folder",
        description="Write CHECKPOINT (a directory picofx train --save wrote, of any layout) as a folder "
                    "transformers.AutoModelForCausalLM.from_pretrained loads: the reference LLaMA as "
                    "LlamaForCausalLM, a Hugging Face model (picofx train --model) as itself.",
        epilog="example:\n  picofx export run1 --hf run1-hf", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a checkpoint (DIR/step-N), or a --save DIR (its newest complete step-N is exported)")
    p.add_argument("--hf", metavar="OUT", required=True, help="the folder to write (new, or empty)")


def run_export(args) -> int:
    try:
        exported = export(args.checkpoint, args.hf)
    except ExportError as e:
        print(f"picofx export: error: {e}", file=sys.stderr)
        return 2
    print(f"picofx export: wrote {args.hf} from {exported} "
          f"(transformers.AutoModelForCausalLM.from_pretrained({args.hf!r}) loads it)")
    return 0


def export(checkpoint: str, out: str) -> pathlib.Path:
    """Write `checkpoint` as a Hugging Face model folder at `out`; returns the checkpoint directory
    it read (a --save directory's newest complete step)."""
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise ExportError("writing a Hugging Face model needs transformers and safetensors: "
                          "pip install 'picofx[hf]'") from None
    directory = checkpoint_directory(pathlib.Path(checkpoint))
    target = pathlib.Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"--hf {out} already exists and is not an empty directory: name a new or empty one")
    options, weights = read_checkpoint(directory)
    try:
        if options.get("model") not in (None, "None"):
            weights, config, source = hf_model_weights(options["model"], weights)
        else:
            weights, config, source = reference_weights(options, weights, directory)
    except NoMapping as e:
        raise ExportError(f"{directory}: {e}: picofx export writes the reference LLaMA (picofx train --size) and "
                          "Hugging Face models (picofx train --model)") from None
    write_folder(target, weights, config, source)
    return directory


def checkpoint_directory(path: pathlib.Path) -> pathlib.Path:
    """`path` itself when it is a checkpoint (a complete step-N, or one saved whole), else the
    newest complete step-N checkpoint in it."""
    directory, reason = find_checkpoint(path)
    if reason == MISSING:
        raise ExportError(f"{path}: no such directory: name a directory picofx train --save wrote")
    if reason == INCOMPLETE:
        raise ExportError(f"{path} is incomplete (its write was interrupted: no {COMPLETE} file): export an "
                          f"older step, or name {path.parent} to export its newest complete one")
    if directory is None:
        raise ExportError(f"{path}: no checkpoint there (picofx train --save DIR writes DIR/step-N, each complete "
                          f"once its {COMPLETE} file is written): name a directory with a complete one")
    return directory


def read_checkpoint(directory: pathlib.Path) -> tuple[dict, dict]:
    """The run's options (name -> text) and the model's parameters (name -> whole tensor)."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    for info in metadata.storage_data.values():  # every piece the metadata lists must be on disk
        file = directory / info.relative_path
        if not file.is_file() or file.stat().st_size < info.offset + info.length:
            raise ExportError(f"{directory} is incomplete: {info.relative_path} is missing or cut short (a rank's "
                              "write did not finish): export an earlier checkpoint, or save again")
    entries = metadata.state_dict_metadata
    options = {k.split(".", 1)[1]: None for k, v in entries.items()
               if k.startswith("options.") and isinstance(v, BytesStorageMetadata)}
    weights = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()
               if k.startswith(MODEL_KEY) and isinstance(v, TensorStorageMetadata)}
    if not weights:
        raise ExportError(f"{directory} holds no model parameters (no '{MODEL_KEY}...' entries): it was not written "
                          "by picofx train --save")
    state = {**weights, "options": options}
    with single_process_quiet():
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return state["options"], {k[len(MODEL_KEY):]: v for k, v in weights.items()}


def reference_weights(options: dict, weights: dict, directory: pathlib.Path):
    """The reference LLaMA's weights renamed for LlamaForCausalLM and its config (from the size the
    run was trained at, its vocabulary and positions as the run built it); no folder to copy from."""
    if not is_reference_llama(weights):
        raise NoMapping(f"its parameters ({', '.join(list(weights)[:3])} ...) are not the reference LLaMA's")
    size = options.get("size")
    if size not in CONFIGS:
        raise ExportError(f"{directory} records no model size (its options hold {sorted(options) or 'none'}): it "
                          "was not written by picofx train --save, which records --size")
    positions = options.get("max_positions")
    config = dataclasses.replace(CONFIGS[size], vocab_size=weights["embedding.weight"].shape[0],
                                 max_position_embeddings=int(positions) if positions not in (None, "None")
                                 else CONFIGS[size].max_position_embeddings)
    layers = 1 + max(int(n.split(".")[1]) for n in weights if n.startswith("decoder_layers."))
    if weights["embedding.weight"].shape[1] != config.hidden_size or layers != config.num_hidden_layers:
        raise ExportError(f"{directory} records --size {size}, but its weights are another size ({layers} layers of "
                          f"{weights['embedding.weight'].shape[1]}): the checkpoint's options do not match it")
    return *reference_to_hf(weights, config), None


def hf_model_weights(model: str, weights: dict):
    """A Hugging Face model's weights under its own names, its config, and where it came from."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ExportError(f"the checkpoint trained the Hugging Face model {model!r}, whose config cannot be read "
                          f"here ({str(e).splitlines()[0]}): export where {model} is available") from None
    source = pathlib.Path(model)
    return hf_to_hf(weights, config), config, source if source.is_dir() else None


def current_umask() -> int:
    mask = os.umask(0o022)  # reading the mask means setting it: put back at once
    os.umask(mask)
    return mask


def write_folder(out: pathlib.Path, weights: dict, config, source: pathlib.Path | None) -> None:
    """safetensors files (with an index when more than one), config.json, generation_config.json,
    and the tokenizer files and generation config of the model's own folder, where it has them."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    split = split_torch_state_dict_into_shards(weights, max_shard_size=SHARD_SIZE)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: weights[n].contiguous() for n in names}, str(out / filename), metadata={"format": "pt"})
        (out / filename).chmod(0o666 & ~current_umask())  # safetensors writes 0600: readable as any file is
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    stored = {t.dtype for t in weights.values() if t.is_floating_point()}
    if len(stored) == 1:  # the weights' own dtype, not the one a pretrained config named (from_pretrained reads it)
        setattr(config, "dtype" if "dtype" in config.to_dict() else "torch_dtype", stored.pop())
    config.save_pretrained(str(out))
    copied = [f for f in (*TOKENIZER_FILES, "generation_config.json") if source and (source / f).is_file()]
    for name in copied:
        shutil.copy2(source / name, out / name)
    if "generation_config.json" not in copied:
        GenerationConfig.from_model_config(config).save_pretrained(str(out))
