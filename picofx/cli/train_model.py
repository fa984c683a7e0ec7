"""The model picofx train trains and its tokens: the reference LLaMA at --size on the byte
tokenizer, or with --model a Hugging Face causal LM (LlamaForCausalLM, Qwen2ForCausalLM, ...) from
its config, randomly initialised or with its pretrained weights (--init-from-hf), on its own
tokenizer's tokens. Both are trained on inputs and labels already shifted by the data (seq + 1
token windows), with the same loss: the mean cross-entropy of every position's next token."""
from __future__ import annotations

import dataclasses
import pathlib
import typing

import torch

from picofx.cli.train_data import load_tokens, tokenized
from picofx.data.hub import offline_unless_the_hub_answers
from picofx.models.llama import CONFIGS, Llama, LlamaConfig, causal_lm_loss

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


class TrainedModel(typing.NamedTuple):
    model: torch.nn.Module
    loss_fn: typing.Callable
    tokens: object     # a tensor of token ids, or a memory-mapped token file's tokens
    data_line: str     # how the tokens came to be, for the run's log ("" for the byte tokenizer)


def logits_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """A Hugging Face model's output (its logits), scored against labels already shifted."""
    return causal_lm_loss(getattr(output, "logits", output), labels)


def hf_config(source: str):
    from transformers import AutoConfig

    if not pathlib.Path(source).is_dir():
        offline_unless_the_hub_answers()  # a hub name: fail at once where the hub does not answer
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        where = "a directory without a readable config.json" if pathlib.Path(source).is_dir() else \
            "not a local directory, and not a model the Hugging Face hub answered for"
        raise ValueError(f"--model {source}: {where} ({str(e).splitlines()[0]}): name a directory holding the "
                         "model's config.json and tokenizer files, or a hub model name with network access") from None


def hf_tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--model {source}: its tokenizer cannot be loaded ({str(e).splitlines()[0]}): the "
                         "directory needs the tokenizer's files (tokenizer.json, tokenizer_config.json), as "
                         "tokenizer.save_pretrained writes them") from None


def check_model(args) -> None:
    """--model and --init-from-hf, checked before any process group (ValueError says what to do)."""
    if args.model is None:
        if args.init_from_hf:
            raise ValueError("--init-from-hf loads a Hugging Face model's weights: give the model with --model DIR")
        return
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError(f"--model {args.model} needs transformers: pip install 'picofx[hf]'") from None
    config = hf_config(args.model)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"--model {args.model}: a {config.model_type} config is not a causal LM "
                         "(AutoModelForCausalLM has no class for it): name a causal LM such as Llama or Qwen2")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and args.seq > positions:
        raise ValueError(f"--seq {args.seq} is longer than {args.model}'s position limit, {positions} "
                         "(max_position_embeddings): pass a shorter --seq")
    vocabulary = len(hf_tokenizer(args.model))
    if vocabulary > config.vocab_size:
        raise ValueError(f"--model {args.model}: its tokenizer has {vocabulary} tokens and the model's embedding "
                         f"{config.vocab_size} rows: give a tokenizer of the model's vocabulary")
    if args.init_from_hf and pathlib.Path(args.model).is_dir() and \
            not any(f for pattern in WEIGHT_FILES for f in pathlib.Path(args.model).glob(pattern)):
        raise ValueError(f"--init-from-hf: {args.model} holds no weights (no .safetensors or pytorch_model.bin "
                         "file): save them there with save_pretrained, or leave --init-from-hf out to train "
                         "from a random initialisation")


def planned_shape(args) -> tuple[LlamaConfig, bool]:
    """The run's model as the planner and the memory estimate describe one (a LlamaConfig's shapes:
    vocabulary, hidden size, MLP width, layers, heads, positions), and whether its output head is
    its embedding (tied, one matrix fewer). The reference LLaMA at --size on the byte tokenizer, or
    --model's config (a model of another kind is planned as the LLaMA of its shape)."""
    if args.model is None:
        positions = args.max_positions or CONFIGS[args.size].max_position_embeddings
        return dataclasses.replace(CONFIGS[args.size], vocab_size=256, max_position_embeddings=positions), False
    config = hf_config(args.model)
    hidden, heads = config.hidden_size, config.num_attention_heads
    width = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    shape = LlamaConfig(vocab_size=config.vocab_size, hidden_size=hidden, intermediate_size=width,
                        num_hidden_layers=config.num_hidden_layers, num_attention_heads=heads,
                        num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
                        max_position_embeddings=getattr(config, "max_position_embeddings", None) or args.seq)
    return shape, bool(getattr(config, "tie_word_embeddings", False))


def build(args) -> TrainedModel:
    """The model on `args.device` (seeded by --seed), its loss and the tokens of --data."""
    torch.manual_seed(args.seed)
    if args.model is None:
        positions = args.max_positions or CONFIGS[args.size].max_position_embeddings
        config = dataclasses.replace(CONFIGS[args.size], vocab_size=256, max_position_embeddings=positions)
        model = Llama(config).to(args.device)
        return TrainedModel(model, causal_lm_loss, load_tokens(args.data), "")
    from transformers import AutoModelForCausalLM

    config = hf_config(args.model)
    config.use_cache = False
    if args.init_from_hf:
        model = AutoModelForCausalLM.from_pretrained(args.model, config=config, dtype=torch.float32,
                                                     attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    found, line = tokenized(args.data, hf_tokenizer(args.model), args.data_cache)
    return TrainedModel(model.train().to(args.device), logits_loss, found.tokens(), line)
