"""picofx train's command line: every option with its help. The checks on them are train_args'."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from picofx.compression.registry import spellings
from picofx.cost.device import device_for
from picofx.cost.units import check_budget
from picofx.models.llama import CONFIGS
from picofx.passes.precision.float8_linear import RECIPES as FLOAT8_RECIPES
from picofx.cli.train_guards import add_guard_options
from picofx.cli.train_profile import add_profile_options

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
ARGPARSE_ERRORS = ("argument ", "unrecognized arguments", "the following arguments")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad option as one line, printed by rank 0 only under torchrun."""

    speaks = True

    def error(self, message: str):
        if self.speaks:
            hint = " (--help lists the options)" if message.startswith(ARGPARSE_ERRORS) else ""
            print(f"{self.prog}: error: {message}{hint}", file=sys.stderr)
        sys.exit(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and gives every option's default."""


def at_least(lowest: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be at least {lowest}, got {value}")
        return value
    return parse


def memory_budget(text: str):
    """'2GiB' or bytes ('2147483648') stay as picofx reads them; '0.5' is a fraction of the peak."""
    value: int | float | str = text
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            pass
    try:
        check_budget(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def step_bytes(config, batch: int, seq: int, tied: bool = False) -> int:
    """A step's memory, roughly: fp32 weights, gradients and AdamW's two moments (16 bytes per
    parameter), saved activations of 2 x (34 x hidden + 5 x heads x seq) bytes per token and layer
    (Korthikanti et al.'s 16-bit estimate, doubled for fp32), and the logits with their gradient.
    `tied`: the output head is the embedding's matrix."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * config.head_dim
    params = (1 if tied else 2) * config.vocab_size * h + layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h
    tokens = batch * seq
    activations = tokens * layers * 2 * (34 * h + 5 * config.num_attention_heads * seq)
    return 16 * params + activations + 2 * 4 * tokens * config.vocab_size


def fits(size: str, batch: int, seq: int, device: str) -> bool:
    config = dataclasses.replace(CONFIGS[size], vocab_size=256)
    return step_bytes(config, batch, seq) <= device_for(device).memory_capacity

def build_parser(doc: str, speaks: bool = True) -> OneLineParser:
    p = OneLineParser(prog="picofx train", description=doc, formatter_class=HelpFormatter)
    p.speaks = speaks
    default_device = "cpu"
    offered = [size for size in CONFIGS if fits(size, 8, 128, default_device)]
    p.add_argument("--size", choices=sorted(CONFIGS), default="tiny", metavar="SIZE",
                   help=f"model shape, vocabulary set to 256; on {default_device} at the default batch and "
                        f"sequence: {', '.join(offered)} (a size whose step does not fit the device is refused)")
    p.add_argument("--steps", type=at_least(1), default=200, help="optimizer steps (in all, a resumed run included)")
    p.add_argument("--batch", type=at_least(1), default=8, help="sequences per step (and per replica)")
    p.add_argument("--seq", type=at_least(2), default=128, help="tokens per sequence")
    p.add_argument("--max-positions", type=at_least(1),
                   help="the model's position limit (RoPE table); default: the size's own, e.g. tiny's 128")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (20 steps of warm-up)")
    p.add_argument("--device", default=default_device, help="torch device: cpu, cuda, cuda:1")
    p.add_argument("--backend", choices=["inductor", "eager"], default="inductor",
                   help="inductor generates code (20-30 s to compile on CPU); eager runs the graphs as they are")
    p.add_argument("--passes", nargs="*", default=["fuse"], help="picofx passes, e.g. fuse precision checkpoint")
    p.add_argument("--float8", choices=FLOAT8_RECIPES, metavar="RECIPE",
                   help="the linear layers in float8 (pass precision's float8, added if --passes lacks precision): "
                        f"{', '.join(FLOAT8_RECIPES)}")
    p.add_argument("--float8-layers", default="auto", metavar="auto|all|GLOB,...",
                   help="with --float8: where the cost rule predicts a gain (auto), every linear layer the kernels "
                        "take (all), or the layers whose module path matches a glob")
    p.add_argument("--memory-budget", type=memory_budget, metavar="BUDGET",
                   help="the checkpoint pass's budget: bytes, '2GiB', or a fraction of the peak without it "
                        "('0.5'); default: the device's memory")
    p.add_argument("--log-every", type=at_least(1), default=25, help="steps between loss and tokens/s lines")
    p.add_argument("--dump-dir", help="write every graph picofx produced to this directory")
    p.add_argument("--report", metavar="FILE", help="at the end, write picofx's report with the run's loss curve as one "
                                                    "self-contained HTML page (the first rank's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the batches")
    p.add_argument("--data", metavar="SOURCE",
                   help="a text file (read as bytes; .jsonl: each line's text field), a dataset saved with datasets' "
                        "save_to_disk, or a Hugging Face dataset name (needs `datasets`); default: the stdlib's source")
    p.add_argument("--model", metavar="NAME_OR_DIR",
                   help="train a Hugging Face causal LM (Llama, Qwen2, ...) from its config instead of the reference "
                        "LLaMA, on --data tokenized by its own tokenizer (needs transformers); --size is then unused")
    p.add_argument("--init-from-hf", action="store_true", help="with --model: start from its pretrained weights")
    p.add_argument("--data-cache", metavar="DIR", help="with --model: where token files are kept (tokenized once, "
                   "memory-mapped by later runs); default: picofx's cache directory, tokens/")
    p.add_argument("--data-workers", type=at_least(0), default=1, metavar="N",
                   help="DataLoader worker processes preparing batches ahead of the step (0: in the step)")
    p.add_argument("--save", metavar="DIR", help="save model, optimizer, step and data position to DIR/step-N at "
                   "the end (and every --save-every steps, and on SIGTERM or Ctrl-C), written in the background")
    p.add_argument("--save-every", type=at_least(1), metavar="N", help="with --save: a checkpoint every N steps too")
    p.add_argument("--keep", type=at_least(1), metavar="K", help="with --save: keep the newest K complete checkpoints")
    p.add_argument("--resume", metavar="DIR", help="continue a run saved with --save (same options): a step-N "
                   "directory, the --save DIR (its newest complete one), or auto (that, or a fresh start if none)")
    p.add_argument("--pp", type=at_least(1), default=1, help="pipeline stages (pass pipeline; run under torchrun)")
    p.add_argument("--dp", type=at_least(1),
                   help="data-parallel replicas (run under torchrun); default: all ranks not used by --pp")
    p.add_argument("--tp", type=at_least(1), default=1,
                   help="tensor-parallel ranks (pass tensor_parallel, plan read from the graph; run under torchrun)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="under --tp, norms and residual adds on sequence shards (Megatron's sequence parallelism)")
    p.add_argument("--async-tp", action=argparse.BooleanOptionalAction,
                   help="under --sequence-parallel, split its gathers and reduce-scatters into chunks overlapped "
                        "with the linears they feed or follow (async TP); default: on with --sequence-parallel")
    p.add_argument("--shard", action="store_true",
                   help="the data-parallel ranks shard parameters, gradients and optimizer state (pass shard, "
                        "as FSDP) instead of each holding a replica (pass overlap)")
    p.add_argument("--shard-stage", type=int, choices=(1, 2, 3), default=3, metavar="N",
                   help="with --shard, what is sharded (ZeRO's stages): 1 the optimizer state (gradients reduce-"
                        "scattered once per step, parameters gathered after it), 2 also the gradients (reduce-"
                        "scattered per micro-batch), 3 also the parameters (gathered in each step)")
    p.add_argument("--dp-replicate", type=at_least(1), default=1, metavar="R",
                   help="with --shard, HSDP: R replicas, each sharded over --dp ranks (pass overlap all-reduces the "
                        "shards' gradients across the replicas); torchtitan's data_parallel_replicate_degree")
    p.add_argument("--cp", type=at_least(1), default=1,
                   help="context-parallel ranks (pass context_parallel): each computes its part of every sequence "
                        "and attends over all keys; with --shard the shard group spans dp x cp (torchtitan's "
                        "dp_shard_cp)")
    p.add_argument("--cp-method", choices=["allgather", "ring"], default="allgather",
                   help="with --cp: each attention gathers the keys and values (allgather, Llama 3's way) or passes "
                        "them around the cp ranks block by block, merged by log-sum-exp (ring: no rank holds "
                        "every key)")
    p.add_argument("--compress", metavar="KIND",
                   help="under --dp, the replicas exchange compressed gradients in the backward (pass overlap's "
                        "compress; with --shard, pass shard's, its reduce-scatter compressed): "
                        f"{', '.join(spellings())}, sparse_rows or sparse_rows+KIND")
    p.add_argument("--compress-warmup", metavar="N", type=at_least(0), default=0,
                   help="with --compress, the run's first N steps exchange whole gradients (the passes' warmup, "
                        "as torch's PowerSGD hook's start_powerSGD_iter); a resumed run warms up what is left")
    p.add_argument("--layout", choices=["auto"],
                   help="auto: under torchrun, the layout picofx.plan predicts fastest for the launch's ranks among "
                        "those this script runs (rank 0 plans and prints which and why); --batch is then the "
                        "global batch, split among the replicas")
    p.add_argument("--schedule", choices=SCHEDULES, default="1F1B", help="pipeline schedule")
    p.add_argument("--microbatches", type=at_least(1), default=4, help="micro-batches per step and replica under --pp")
    p.add_argument("--measure-cuts", action=argparse.BooleanOptionalAction, default=True,
                   help="under --pp, cut where unit times measured on rank 0 balance (--no-measure-cuts: predicted)")
    add_guard_options(p)  # --collective-timeout, --skip-nonfinite, --metrics, --tensorboard
    add_profile_options(p)  # --profile, --calibrate
    return p
