"""Fusion rule for the final projection and the cross-entropy loss: a chunked fused op that never
materializes the (tokens x vocab) logits, forward or backward.

It matches F.cross_entropy on the projection's output however real code writes it: labels are
any int64 tensor with one entry per scored token (flattened, shifted by padding as Hugging Face
does, or not, upstream of the rule); mean or sum reduction, any ignore_index; logits upcast with
.float() or not, flattened as view(-1, V) (Hugging Face, nanoGPT), view(B * T, -1) (the seed),
reshape or flatten(0, 1), or first shifted as logits[..., :-1, :].contiguous() (older scripts:
the fused op then reads x[..., :-1, :]); divided by a scale (Granite) or soft-capped as
tanh(logits / c) * c (Gemma 2), which the fused op computes chunk by chunk too. Label smoothing,
class weights and weighted per-token losses are other math: picofx.passes.fuse.sites names them.
The pattern also returns the logits: when the graph returns them too (Hugging Face's output),
they become None unless the rule's keep_logits option is set. Its chunking option sizes the chunks:
`chunking_for` the device (the fuse pass sets it from ctx), one chunk on a GPU where the logits fit.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from picofx.cost.gpus import GpuProfile
import picofx.kernels  # noqa: F401  (registers torch.ops.picofx)
from picofx.kernels import DEFAULT_CHUNK_SIZE
from picofx.rewrite import Rule, register_rule, scalar, tensor

# On a CPU, tokens per chunk: as many as keep one chunk's fp32 logits near this many bytes (the op
# holds one such buffer at a time), but at least MIN_CHUNK_TOKENS: every chunk reads and writes the
# whole (vocab x hidden) weight-gradient sum, and the logits matmul runs slower on few rows.
# Measured on CPU at vocab 32000, hidden 256, 4096 tokens: 128-token chunks made the fused loss
# 15% slower than torch.compile's unfused one, 512-token chunks 2% faster; there the 64 MiB chunk
# buffer sets the step's peak (tools/bench_fuse.py: 601 MiB, 569 with 128-token chunks).
LOGITS_CHUNK_BYTES = 64 * 2**20
MIN_CHUNK_TOKENS = 512
# On a GPU, one chunk while the fp32 logits of all tokens fit in this share of the device's memory:
# every further chunk moves the (vocab x hidden) weight-gradient sum once more (at Llama-3.2-1B's
# shape, 4 x 2048 tokens, 1 GB in fp32 a chunk) and runs the matmuls on fewer rows. An H200's
# sixteenth is 8.8 GB, twice the 4.2 GB of fp32 logits at that shape. Where they do not fit, memory
# alone sets the chunk (no floor).
LOGITS_MEMORY_SHARE = 1 / 16


@dataclass(frozen=True)
class LossChunking:
    """How the fused loss splits its tokens: chunks whose fp32 logits take at most `logits_bytes`,
    of at least `min_tokens` and at most `max_tokens` tokens (None: no limit), all of one size when
    `balanced` (2 x 4096 tokens, not 5232 + 2960); `why` says where the figures come from."""
    logits_bytes: int
    min_tokens: int = MIN_CHUNK_TOKENS
    max_tokens: int | None = None
    balanced: bool = False
    why: str = ""

    def chunk_size(self, vocab: int, n_tokens: int) -> int:
        tokens = max(self.min_tokens, self.logits_bytes // (4 * vocab))
        if self.max_tokens is not None:
            tokens = min(tokens, self.max_tokens)
        tokens = max(1, min(tokens, n_tokens))
        return int(-(-n_tokens // -(-n_tokens // tokens)) if self.balanced and n_tokens else tokens)


CPU_CHUNKING = LossChunking(LOGITS_CHUNK_BYTES, max_tokens=DEFAULT_CHUNK_SIZE,
                            why=f"CPU: {LOGITS_CHUNK_BYTES // 2**20} MiB of fp32 logits a chunk (at least "
                                f"{MIN_CHUNK_TOKENS} tokens), the fastest measured there")


def chunking_for(device, memory_capacity: int | None = None) -> LossChunking:
    """The chunking on `device` (a torch.device), whose memory holds `memory_capacity` bytes
    (picofx.cost's device description; None: the device's own total, for a GPU)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPU_CHUNKING
    if memory_capacity is None:
        memory_capacity = torch.cuda.get_device_properties(device).total_memory
    budget = int(memory_capacity * LOGITS_MEMORY_SHARE)
    return LossChunking(budget, min_tokens=1, balanced=True,
                        why=f"{device.type}: a chunk's fp32 logits up to 1/{round(1 / LOGITS_MEMORY_SHARE)} of its "
                            f"{memory_capacity / 2**30:.0f} GiB ({budget / 2**30:.1f} GiB)")


def context_chunking(ctx) -> LossChunking:
    """The chunking for the pass's context: its device, described by its cost model."""
    if ctx is None:
        return CPU_CHUNKING
    described = getattr(ctx.cost_model, "device", None)
    if isinstance(described, GpuProfile):  # a GPU run predicted on this machine chunks as on that GPU
        return chunking_for("cuda", described.memory_capacity)
    return chunking_for(ctx.device, getattr(described, "memory_capacity", None))


def _argument(node: torch.fx.Node, index: int):
    """The op's argument `index`, given or (dropped from the call when it equals it) its schema default."""
    if index < len(node.args):
        return node.args[index]
    argument = node.target._schema.arguments[index]
    return node.kwargs.get(argument.name, argument.default_value)


def chunking_notes(graph: torch.fx.Graph, chunking: LossChunking) -> list[str]:
    """One line per fused loss in `graph`: its chunk count and why."""
    lines = []
    for node in graph.find_nodes(op="call_function", target=torch.ops.picofx.linear_cross_entropy.default):
        x, weight, chunk = node.args[0].meta.get("val"), node.args[1].meta.get("val"), _argument(node, 7)
        if x is None or weight is None:
            continue
        n_tokens = x.shape[:-1].numel()
        chunks = -(-n_tokens // chunk) if n_tokens else 0
        lines.append(f"{node.name}: {chunks} chunk{'s' * (chunks != 1)} of {chunk} tokens "
                     f"({n_tokens} tokens x vocab {weight.shape[0]}); {chunking.why}")
    return lines


def view_last(scores):
    return scores.view(-1, scores.size(-1))


def view_tokens(scores):  # logits.view(B * T, -1)
    return scores.view(scores.shape[0] * scores.shape[1], -1)


def flatten_tokens(scores):
    return scores.flatten(0, 1)


def transformed(logits, scale, softcap):
    if scale is not None:
        logits = logits / scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def linear_cross_entropy_pattern(x, weight, bias, labels, ignore_index, reduction, upcast, scale, softcap, flatten,
                                 shift):
    logits = transformed(F.linear(x, weight, bias), scale, softcap)  # (..., T, V)
    scores = logits.float() if upcast else logits
    if shift:  # the last position predicts no token: logits[..., :-1, :], labels shifted upstream
        scores = scores[..., :-1, :].contiguous()
    loss = F.cross_entropy(flatten(scores), labels, ignore_index=ignore_index, reduction=reduction)
    return loss, logits


def linear_cross_entropy_replacement(x, weight, bias, labels, ignore_index, reduction, upcast, scale, softcap,
                                     flatten, shift, keep_logits=False, chunking=CPU_CHUNKING):
    tokens = x[..., :-1, :] if shift else x
    chunk = chunking.chunk_size(weight.shape[0], tokens.shape[:-1].numel())
    loss = torch.ops.picofx.linear_cross_entropy(tokens, weight, bias, labels, ignore_index, reduction, upcast,
                                                 chunk, True, float(scale or 1.0), float(softcap or 0.0))[0]
    return loss, transformed(F.linear(x, weight, bias), scale, softcap) if keep_logits else None


def labels_are_token_ids(match):
    x, labels = match.val("x"), match.val("labels")
    shift = match.rule.variant_inputs(match.pattern.variant)[0]["shift"]
    tokens = x.shape[:-2].numel() * (x.shape[-2] - 1) if shift else x.shape[:-1].numel()
    if labels.dtype != torch.int64:
        return f"labels are {labels.dtype}; the fused loss takes int64 class indices (not probabilities)"
    if labels.numel() != tokens:
        return f"labels {tuple(labels.shape)} do not have one entry per scored token of x {tuple(x.shape)}"
    return None


# fp32; bf16 logits upcast for the loss (Hugging Face); bf16 throughout
UPCASTS = ((torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False))

LINEAR_CROSS_ENTROPY = register_rule(Rule(
    name="linear_cross_entropy", pattern=linear_cross_entropy_pattern, replacement=linear_cross_entropy_replacement,
    inputs={"x": tensor(2, 8, 16), "weight": tensor(64, 16), "bias": None, "labels": tensor(16, dtype=torch.int64),
            "ignore_index": scalar(-12345), "reduction": "mean", "upcast": True, "scale": None, "softcap": None,
            "flatten": view_last, "shift": False},
    variants=[*({"dtype": dtype, "upcast": upcast, "reduction": reduction, "bias": bias}
                for dtype, upcast in UPCASTS for reduction in ("mean", "sum") for bias in (None, tensor(64))),
              *({"dtype": dtype, "upcast": upcast, **form} for dtype, upcast in UPCASTS[:2]
                for form in ({"flatten": view_tokens}, {"flatten": flatten_tokens}, {"scale": scalar(3.0625)},
                             {"softcap": scalar(27.625)})),
              *({"dtype": dtype, "upcast": upcast, "shift": True, "labels": tensor(14, dtype=torch.int64)}
                for dtype, upcast in UPCASTS[:2])],
    checks=(labels_are_token_ids,),
    options={"keep_logits": False, "chunking": CPU_CHUNKING},
    # Chunked log-sum-exp and gradients computed in the forward round differently from
    # log_softmax + autograd: a few ulps of the fp32 loss and gradients.
    tolerance=(1e-5, 1e-5), tolerance_reason="the fused loss sums chunk by chunk, in another order",
))
