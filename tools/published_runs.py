"""Published training runs with the layouts their authors give, for tools/plan_published.py.

Each run: the model's shape, the GPU profile (picofx.cost.gpus) and the cluster's network where it
is not the profile's own, GPUs, sequence, global batch, the layout as picofx's Layout spells it, and
the published tokens/s per GPU (or MFU: tokens/s is then MFU x peak / FLOPs per token, the
planner's 6N + 12 L h T count, the authors' own), memory per GPU where published. `fit`: the
profiles' fitted figures were fitted on this run (tools/plan_published.py --fit); every other run
checks them.

Megatron's GPT models are given as the Llama shape with the same matmul FLOPs and parameters: a
GELU MLP of 4h (two matrices) as a SwiGLU MLP of 8h/3 (three), multi-head attention, their vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

from picofx.models.llama import LlamaConfig
from picofx.planner.layouts import Layout

TITAN_A100 = "torchtitan docs/performance.md, 64 A100 80GB, FSDP2 (2024)"
TITAN_H100 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (H100 96GB HBM2e, 500 W)"
TITAN_405B = "torchtitan docs/performance.md, Llama 3.1 405B, 128 H100 (2024)"
MEGATRON_SP = "Korthikanti et al. 2022, Reducing Activation Recomputation, Tables 3 and 5 (A100 80GB)"


def gpt(hidden: int, layers: int, heads: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=51200, hidden_size=hidden, intermediate_size=round(8 * hidden / 3),
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=2048)


GPT_22B, GPT_175B, GPT_530B, GPT_1T = gpt(6144, 48, 64), gpt(12288, 96, 96), gpt(20480, 105, 128), gpt(25600, 128, 160)


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    model: object  # a zoo name or a LlamaConfig
    gpu: str
    gpus: int
    seq: int
    global_batch: int
    layout: Layout
    tokens_per_gpu: float | None = None
    mfu: float | None = None
    memory_gib: float | None = None
    compiled: bool = True  # torch.compile (fused pointwise kernels) or eager
    fit: bool = False
    every_second_matmul: bool = False  # torchtitan's op-level selective checkpointing: recomputes those too
    loss_on_fp32_logits: bool = False  # cross-entropy outside any compiled region, on an fp32 copy of the logits
    unfused_attention: bool = False  # attention as two batched matmuls around a softmax and dropout kernel
    network: str | None = None  # picofx.cost.gpus.NETWORKS key: the cluster's network, where not the profile's
    sends_scattered: bool = False  # Megatron's pipeline sends: each tp rank 1/tp of the activations
    fused_norm_layer: bool = False  # torchtitan's eager layer with its fused RMSNorm keeps that layer's activations


# torchtitan's performance.md does not name its A100 cluster's network; a reader's comment on
# torchtitan issue 394 (2024-11-22, unanswered) names it AWS's, 400 Gb/s of EFA per node: p4d.
TITAN_A100_NETWORK = "efa-p4d"


def titan_op_sac(gpus: int, precision: str = "bf16") -> dict:
    return {"layout": fsdp(gpus, "selective", precision=precision), "every_second_matmul": True,
            "loss_on_fp32_logits": True}


def titan_a100(**run) -> dict:
    return {"network": TITAN_A100_NETWORK, "compiled": False, **run}


def fsdp(gpus: int, checkpoint: str, microbatches: int = 1, precision: str = "bf16") -> Layout:
    return Layout(gpus, 1, 1, shard=True, microbatches=microbatches, checkpoint=checkpoint, precision=precision)


def megatron(tp: int, pp: int, gpus: int, batch: int, micro: int, selective: bool) -> dict:
    """Tensor parallel with full recomputation, or (the paper's method) sequence parallel with selective."""
    layout = Layout(gpus // (tp * pp), tp, pp, microbatches=batch // (gpus // (tp * pp) * micro),
                    checkpoint="selective" if selective else "full", sequence_parallel=selective)
    # the paper's runs predate FlashAttention in Megatron; its pipeline scatters each send over tp
    return {"layout": layout, "unfused_attention": True, "sends_scattered": True}


RUNS = [
    Published("Llama 3.1 8B, FSDP + compile, 8 GPUs", TITAN_H100 + ", Table 1", "llama3-8b", "h100-96gb", 8, 8192,
              16, tokens_per_gpu=6667, memory_gib=77.0, fit=True, **titan_op_sac(8)),
    # torchao's tensorwise float8 linears (the output projection left bf16), FSDP2's float8 all-gather
    Published("Llama 3.1 8B, FSDP + compile + Float8, 8 GPUs", TITAN_H100 + ", Table 1", "llama3-8b", "h100-96gb", 8,
              8192, 16, tokens_per_gpu=8532, memory_gib=76.8, **titan_op_sac(8, "float8")),
    Published("Llama 3.1 8B, FSDP, 8 GPUs", TITAN_H100 + ", Table 1", "llama3-8b", "h100-96gb", 8, 8192, 16,
              tokens_per_gpu=5762, memory_gib=82.4, compiled=False, **titan_op_sac(8)),
    Published("Llama 3.1 8B, FSDP + compile, 128 GPUs", TITAN_H100 + ", Table 3", "llama3-8b", "h100-96gb", 128,
              8192, 256, tokens_per_gpu=6514, memory_gib=62.0, **titan_op_sac(128)),
    Published("Llama 3.1 8B, FSDP + compile + Float8, 128 GPUs", TITAN_H100 + ", Table 3", "llama3-8b", "h100-96gb",
              128, 8192, 256, tokens_per_gpu=8380, memory_gib=61.8, **titan_op_sac(128, "float8")),
    Published("Llama 3.1 8B, FSDP, 128 GPUs", TITAN_H100 + ", Table 3", "llama3-8b", "h100-96gb", 128, 8192, 256,
              tokens_per_gpu=5605, memory_gib=67.0, compiled=False, **titan_op_sac(128)),
    Published("Llama 3.1 405B, FSDP 16 x TP 8, full checkpointing", TITAN_405B, "llama3-405b", "h100-96gb", 128,
              8192, 32, Layout(16, 8, 1, shard=True, checkpoint="full", sequence_parallel=True), mfu=0.290,
              compiled=False, loss_on_fp32_logits=True),
    Published("Llama 3 8B, selective op checkpointing", TITAN_A100, "llama3-8b", "a100-80gb", 64, 8192, 64,
              tokens_per_gpu=2973, mfu=0.582, fit=True, **titan_a100(fused_norm_layer=True, **titan_op_sac(64))),
    Published("Llama 3 70B, full checkpointing", TITAN_A100, "llama3-70b", "a100-80gb", 64, 8192, 64,
              fsdp(64, "full"), 331, 0.517, **titan_a100(loss_on_fp32_logits=True)),
    Published("Llama 2 13B, batch 2, no checkpointing", TITAN_A100, "llama2-13b", "a100-80gb", 64, 4096, 128,
              fsdp(64, "none"), 2162, 0.611, **titan_a100(loss_on_fp32_logits=True, fused_norm_layer=True)),
    Published("Llama 2 13B, batch 2, selective op checkpointing", TITAN_A100, "llama2-13b", "a100-80gb", 64, 4096,
              128, tokens_per_gpu=1904, mfu=0.538, **titan_a100(fused_norm_layer=True, **titan_op_sac(64))),
    Published("Llama 2 70B, batch 1, selective op checkpointing", TITAN_A100, "llama2-70b", "a100-80gb", 64, 4096,
              64, tokens_per_gpu=355, mfu=0.508, **titan_a100(**titan_op_sac(64))),
    Published("Llama 2 70B, batch 2, full checkpointing", TITAN_A100, "llama2-70b", "a100-80gb", 64, 4096, 128,
              fsdp(64, "full"), 353, 0.505, **titan_a100(loss_on_fp32_logits=True)),
    Published("GPT 22B, TP 8, full recomputation", MEGATRON_SP, GPT_22B, "a100-80gb", 8, 2048, 4,
              **megatron(8, 1, 8, 4, 4, False), mfu=0.415 / 1.42 * 1.10),
    Published("GPT 22B, TP 8, sequence parallel + selective", MEGATRON_SP, GPT_22B, "a100-80gb", 8, 2048, 4,
              **megatron(8, 1, 8, 4, 4, True), mfu=0.415),
    Published("GPT 175B, TP 8 x PP 8, full recomputation", MEGATRON_SP, GPT_175B, "a100-80gb", 64, 2048, 64,
              **megatron(8, 8, 64, 64, 1, False), mfu=0.514 / 18.13 * 13.75),
    Published("GPT 175B, TP 8 x PP 8, sequence parallel + selective", MEGATRON_SP, GPT_175B, "a100-80gb", 64, 2048,
              64, **megatron(8, 8, 64, 64, 1, True), mfu=0.514, fit=True),
    Published("GPT 530B, TP 8 x PP 35, full recomputation", MEGATRON_SP, GPT_530B, "a100-80gb", 280, 2048, 280,
              **megatron(8, 35, 280, 280, 1, False), mfu=0.560 / 49.05 * 37.83),
    Published("GPT 530B, TP 8 x PP 35, sequence parallel + selective", MEGATRON_SP, GPT_530B, "a100-80gb", 280, 2048,
              280, **megatron(8, 35, 280, 280, 1, True), mfu=0.560),
]

NOT_EXPRESSIBLE = [
    ("Llama 3.1 70B/405B with Float8 linears", TITAN_H100 + ", Tables 4-6",
     "Float8 beside tensor parallelism (torchtitan gathers its activations in float8) and async TP are not planned"),
    ("Llama 3.1 405B, 4-D with context parallelism", TITAN_H100 + ", Table 6",
     "TP 8 x PP 8 x FSDP x CP with Float8 and async TP; Table 2 (8B, FSDP x CP) is predicted below, apart"),
    ("Llama 3 8B and Llama 2 13B, selective layer checkpointing", TITAN_A100,
     "checkpointing every other layer: a layout checkpoints all of its layers alike"),
    ("Picotron, Llama-2-7B on 64 H100 (~38% MFU) and SmolLM-1.7B on 8 H100 (~50%)", "Picotron README",
     "the layouts, batches and sequence lengths are not published"),
    ("Narayanan et al. 2021, GPT 1.7B-1T on up to 3072 A100", "Efficient Large-Scale Language Model Training, Table 1",
     "the micro-batch sizes and the interleaved schedule's chunks of each row are not in the table"),
]
