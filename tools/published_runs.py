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

import dataclasses
from dataclasses import dataclass

from picofx.models.llama import LlamaConfig
from picofx.planner.layouts import Layout

TITAN_A100 = "torchtitan docs/performance.md, 64 A100 80GB, FSDP2 (2024)"
TITAN_H100 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (H100 96GB HBM2e, 500 W)"
TITAN_405B = "torchtitan docs/performance.md, Llama 3.1 405B, 128 H100 (2024)"
MEGATRON_SP = "Korthikanti et al. 2022, Reducing Activation Recomputation, Tables 3 and 5 (A100 80GB)"
MEGATRON_2021 = "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters, Table 1"
MT_NLG = "Smith et al. 2022, Megatron-Turing NLG 530B, section 2.4 (global batch 1920, iteration 60.1/50.2/44.4 s)"
LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4 (BF16 MFU, 16M tokens a step) and section 3.3.2 (layouts)"


def gpt(hidden: int, layers: int, heads: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=51200, hidden_size=hidden, intermediate_size=round(8 * hidden / 3),
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=2048)


GPT_22B, GPT_175B, GPT_530B, GPT_1T = gpt(6144, 48, 64), gpt(12288, 96, 96), gpt(20480, 105, 128), gpt(25600, 128, 160)
GPT_76B, GPT_146B, GPT_310B = gpt(10240, 60, 80), gpt(12288, 80, 96), gpt(16384, 96, 128)


def megatron_tokens_per_gpu(teraflops: float, config: LlamaConfig, seq: int) -> float:
    """Tokens/s per GPU from Narayanan et al.'s teraFLOP/s per GPU, which count the FLOPs of a step with
    full recomputation: 96 B s l h^2 (1 + s / 6h + V / 16 l h) a step of B sequences of s tokens."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    return teraflops * 1e12 / (96 * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h)))


def megatron_2021(config: LlamaConfig, pp: int, gpus: int, batch: int, teraflops: float) -> dict:
    """A row of Table 1: tp 8, full recomputation, 2048 tokens. Not in the table, assumed: micro-batches
    of one sequence, and the interleaved schedule with 2 stages per rank (the paper's runs use it)."""
    run = megatron(8, pp, gpus, batch, 1, False)
    run["layout"] = dataclasses.replace(run["layout"], virtual_stages=2)
    return {**run, "tokens_per_gpu": megatron_tokens_per_gpu(teraflops, config, 2048)}


def mt_nlg(gpus: int, seconds: float) -> dict:
    """TP 8 x PP 35 x DP on 280-420 DGX A100, full recomputation; the micro-batch (one sequence) is assumed."""
    return {**megatron(8, 35, gpus, 1920, 1, False), "tokens_per_gpu": 1920 * 2048 / seconds / gpus}


def llama3(gpus: int, cp: int, per_replica: int, mfu: float) -> dict:
    """Table 4: TP 8 x CP x PP 16 x DP, FSDP sharding the optimizer state and gradients but keeping the
    parameters gathered across micro-batches (shard stage 2), on RoCE; section 3.3.2: the interleaved
    schedule, the first and last stages a layer fewer, so that the first chunk of the first stage holds
    the embedding alone: a chunk is one layer's place, 126 layers + embedding + head = 16 ranks x 8
    chunks (8 stages per rank). Micro-batches of one sequence: at 16,384 GPUs each replica's 16
    sequences must fill the 16 ranks (the 8,192-GPU run assumed alike); torch's interleaved 1F1B runs
    16 micro-batches on 16 x 8 stages (one round), as the one micro-batch rule says. Assumed, not in the paper:
    selective checkpointing (the paper ran 8K sequences without any; picofx's layer, keeping fp32 norms
    and residual stream, would not fit without it)."""
    dp = gpus // (8 * 16 * cp)
    layout = Layout(dp, 8, 16, shard=True, shard_stage=2, microbatches=per_replica, checkpoint="selective",
                    sequence_parallel=True, cp=cp, virtual_stages=8)
    return {"layout": layout, "mfu": mfu, "network": "roce-400", "compiled": False, "sends_scattered": True}


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
    even_stages: bool = False  # Megatron's cut: L / pp layers a stage, the head beside the last stage's
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
    return {"layout": layout, "unfused_attention": True, "sends_scattered": True, "even_stages": True}


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
    Published("GPT 76B, TP 8 x PP 4, interleaved, 1,024 GPUs", MEGATRON_2021, GPT_76B, "a100-80gb", 1024, 2048, 1792,
              **megatron_2021(GPT_76B, 4, 1024, 1792, 140)),
    Published("GPT 146B, TP 8 x PP 8, interleaved, 1,536 GPUs", MEGATRON_2021, GPT_146B, "a100-80gb", 1536, 2048,
              2304, **megatron_2021(GPT_146B, 8, 1536, 2304, 148)),
    Published("GPT 310B, TP 8 x PP 16, interleaved, 1,920 GPUs", MEGATRON_2021, GPT_310B, "a100-80gb", 1920, 2048,
              2160, **megatron_2021(GPT_310B, 16, 1920, 2160, 155)),
    Published("GPT 530B, TP 8 x PP 35, interleaved, 2,520 GPUs", MEGATRON_2021, GPT_530B, "a100-80gb", 2520, 2048,
              2520, **megatron_2021(GPT_530B, 35, 2520, 2520, 163)),
    Published("GPT 1T, TP 8 x PP 64, interleaved, 3,072 GPUs", MEGATRON_2021, GPT_1T, "a100-80gb", 3072, 2048, 3072,
              **megatron_2021(GPT_1T, 64, 3072, 3072, 163)),
    # Llama 3 405B on 8,192 and 16,384 H100, its layouts as llama3() derives them from the paper
    Published("Llama 3 405B, 8,192 GPUs", LLAMA3, "llama3.1-405b", "h100", 8192, 8192, 2048,
              **llama3(8192, 1, 32, 0.43)),
    Published("Llama 3 405B, 16,384 GPUs", LLAMA3, "llama3.1-405b", "h100", 16384, 8192, 2048,
              **llama3(16384, 1, 16, 0.41)),
    Published("Llama 3 405B, 16,384 GPUs, CP 16, 131,072 tokens", LLAMA3, "llama3.1-405b", "h100", 16384, 131072, 128,
              **llama3(16384, 16, 16, 0.38)),
    # runs of 1,000 GPUs and more above: the rows of Narayanan et al.'s Table 1 from 1,024 GPUs, Llama 3's
]

# Runs of 1,000 GPUs and more kept apart from RUNS, not within 15% with the one calibration: MT-NLG
# 530B is predicted 31-36% fast with one-sequence micro-batches (it ran at 126-113 teraFLOP/s per GPU
# where Narayanan et al.'s 530B ran at 163 on the same kind of cluster). Its micro-batch size is not
# published: its throughput falls 11% from 2,240 to 3,360 GPUs at a fixed batch, twice what the bubble
# of one-sequence micro-batches explains (6%) and what two-sequence ones would (11%), which are still
# predicted 16-18% fast.
LARGE_RUNS = [
    Published("MT-NLG 530B, 2,240 GPUs", MT_NLG, GPT_530B, "a100-80gb", 2240, 2048, 1920, **mt_nlg(2240, 60.1)),
    Published("MT-NLG 530B, 2,800 GPUs", MT_NLG, GPT_530B, "a100-80gb", 2800, 2048, 1920, **mt_nlg(2800, 50.2)),
    Published("MT-NLG 530B, 3,360 GPUs", MT_NLG, GPT_530B, "a100-80gb", 3360, 2048, 1920, **mt_nlg(3360, 44.4)),
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
    ("Narayanan et al. 2021, GPT 1.7B-39B on 32-512 A100", MEGATRON_2021,
     "below 1,024 GPUs, not added; the rows from 1,024 GPUs are predicted above (micro-batches and chunks assumed)"),
    ("MegaScale, 175B on up to 12,288 GPUs (55.2% MFU)", "Jiang et al. 2024, MegaScale, abstract",
     "parallel transformer blocks, sliding-window attention and LAMB: not a picofx model; its layouts per row "
     "were not found"),
]
