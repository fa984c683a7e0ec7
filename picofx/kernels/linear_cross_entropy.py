"""The final projection fused with the cross-entropy loss, chunked over tokens.

    picofx::linear_cross_entropy(Tensor x, Tensor weight, Tensor? bias, Tensor labels,
                                 int ignore_index=-100, str reduction="mean", bool upcast=True,
                                 int chunk_size=2048, bool compute_grad=True, float scale=1.0,
                                 float softcap=0.0)
        -> (Tensor loss, Tensor grad_x, Tensor grad_weight, Tensor grad_bias)

    loss equals F.cross_entropy(scores.float() if upcast else scores, labels.flatten(),
    ignore_index=ignore_index, reduction=reduction) with logits = F.linear(x.flatten(0, -2),
    weight, bias) and scores = logits / scale, soft-capped to tanh(scores / softcap) * softcap
    when softcap > 0 (Granite divides its logits by a scale; Gemma 2 soft-caps them; the two
    are computed in fp32): x (..., C), weight (V, C), bias (V,) or None, labels (...) int64 with
    x.shape[:-1] == labels.shape. reduction is "mean" (over non-ignored tokens; nan when all
    are ignored, as F.cross_entropy) or "sum". The loss is fp32 with upcast, else in the
    logits' dtype; softmax statistics are fp32 either way.

    The (N, V) logits are never materialized: tokens are processed chunk_size at a time, and
    since the loss is the graph's last op, the gradients with respect to x, weight and bias
    are computed in the same pass (softmax - one_hot is known once a chunk's logits are) and
    returned as extra, non-differentiable outputs: the gradients of the *summed* token losses.
    The backward multiplies them by the incoming gradient (and the mean's 1 / count) in fp32 and
    rounds once to the inputs' dtypes: one pointwise pass that Inductor fuses. That costs no
    recomputation matmul (3 matmuls in all, as unfused). grad_weight and grad_bias are fp32 when
    low-precision chunks add up (several chunks) or the dtype is fp16 (a sum over tokens can
    leave its range), else in the weight's dtype (one chunk: one matmul, no accumulator); chunks
    add into the fp32 sum without a per-chunk (V, C) product in low precision. With
    compute_grad=False they are empty and the gradient matmuls are skipped; differentiating such
    a call raises. grad_bias is empty when bias is None.

Use `linear_cross_entropy(...)` below for the loss alone: it sets compute_grad from autograd.
chunk_size trades memory, chunk_size * V logits (plus an fp32 copy on the generic path), for
speed: every chunk reads and writes the (V, C) grad_weight accumulator once, so chunks much
smaller than C make the backward matmuls memory-bound; one chunk has no accumulator. A soft-cap
holds one more (n, V) fp32 buffer per chunk (the derivative of tanh). The fuse pass sizes the
chunks for the device (picofx.passes.fuse.loss). `linear_cross_entropy_decomposition` is the op
in ATen ops, chunks unrolled, for Inductor: picofx.kernels.inductor_decompositions() holds it.
"""
from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

try:
    from picofx.kernels import triton_cross_entropy
except ImportError:  # no triton: CUDA runs the generic chunk step below
    triton_cross_entropy = None

DEFAULT_CHUNK_SIZE = 2048


def cross_entropy_chunk(logits: Tensor, labels: Tensor, loss_out: Tensor, grad_scale: Tensor,
                        ignore_index: int, compute_grad: bool) -> Optional[Tensor]:
    """One chunk's loss per token into loss_out (n,), and its d(loss)/d(logits) (n, V).

    grad_scale is a 0-dim fp32 tensor multiplied into the gradient, or None for the gradient of
    the summed losses (the caller then scales the far smaller products with x and weight).
    Ignored tokens get loss 0 and gradient 0. fp32 logits are overwritten (the gradient takes
    their buffer), so a chunk holds one (n, V) buffer, not two.
    """
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, 0)[:, None]  # (n, 1)
    log_probs = logits.float()  # (n, V); the same buffer when logits are fp32
    torch.log_softmax(log_probs, dim=-1, out=log_probs)  # in place: the op F.cross_entropy uses
    target = log_probs.gather(1, safe_labels)
    loss_out.copy_(torch.where(valid, -target.squeeze(1), 0.0))
    if not compute_grad:
        return None
    grad = log_probs.exp_()  # softmax, in the buffer log_softmax gave: no second (n, V) tensor
    grad.scatter_add_(1, safe_labels, torch.full_like(target, -1.0))
    if grad_scale is None:
        grad.index_fill_(0, (~valid).nonzero().squeeze(1), 0.0)  # touches the ignored rows only
    else:
        grad.mul_(torch.where(valid, grad_scale, 0.0)[:, None])
    return grad.to(logits.dtype)


def _check_args(x, weight, labels, reduction):
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r} "
                         "(per-token losses would need the unreduced logits gradient in the backward)")
    torch._check(x.shape[:-1].numel() == labels.numel(),
                 lambda: f"linear_cross_entropy: x {tuple(x.shape)} and labels {tuple(labels.shape)} "
                         "disagree on the number of tokens")
    torch._check(x.shape[-1] == weight.shape[1],
                 lambda: f"linear_cross_entropy: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")


def _loss_dtype(x, weight, upcast):
    return torch.float32 if upcast else torch.promote_types(x.dtype, weight.dtype)


def _transform(logits: Tensor, scale: float, softcap: float) -> tuple[Tensor, Optional[Tensor]]:
    """The chunk's scores in fp32 (in the logits' buffer when they are fp32), and the derivative
    of the scores by the logits: None for the identity, a (n, V) tensor for a soft-cap."""
    if scale == 1.0 and not softcap:
        return logits, None
    scores = logits.float()
    if scale != 1.0:
        scores.div_(scale)
    if not softcap:
        return scores, None
    scores.div_(softcap).tanh_()
    derivative = (1.0 - scores * scores).div_(scale)  # (n, V): d(tanh(z / c) * c)/dz, times 1/scale
    return scores.mul_(softcap), derivative


def weight_grad_dtype(weight: Tensor, n_tokens: int, chunk_size: int) -> torch.dtype:
    """The dtype of the op's grad_weight (and grad_bias): see the module docstring."""
    several_chunks = n_tokens > chunk_size
    if weight.dtype == torch.float16 or (weight.dtype == torch.bfloat16 and several_chunks):
        return torch.float32
    return weight.dtype


def add_weight_grad(total: Optional[Tensor], grad_logits: Tensor, x_chunk: Tensor, dtype: torch.dtype,
                    inplace: bool = False) -> Tensor:
    """total + grad_logits.T @ x_chunk, (V, C) in `dtype` (total None: the first chunk's product).

    A low-precision chunk adds into an fp32 total inside the matmul (CUDA's mm/addmm with
    out_dtype), never through a (V, C) product rounded to its dtype first. The CPU has no such
    matmul: there the (n, V) chunk and x are upcast, which costs less than a (V, C) temporary
    while n < 2 C and is exact."""
    a, b = grad_logits.T, x_chunk  # (V, n), (n, C)
    mixed = a.dtype != dtype
    if mixed and a.device.type != "cuda":
        a, b, mixed = a.to(dtype), b.to(dtype), False
    dtype_args = {"out_dtype": dtype} if mixed else {}
    if total is None:
        return torch.mm(a, b, **dtype_args)
    return torch.addmm(total, a, b, **dtype_args, **({"out": total} if inplace else {}))


def _linear_cross_entropy_chunked(x, weight, bias, labels, ignore_index, reduction, upcast,
                                  chunk_size, compute_grad, chunk_step, scale=1.0, softcap=0.0):
    _check_args(x, weight, labels, reduction)
    x2 = x.reshape(-1, x.shape[-1])  # (N, C)
    labels = labels.reshape(-1)  # (N,)
    n_tokens = x2.shape[0]
    loss_per_token = torch.empty(n_tokens, dtype=torch.float32, device=x.device)
    grad_x = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if compute_grad else x.new_empty(0)  # (N, C)
    grad_weight = grad_bias = None  # the sums over chunks
    sum_dtype = weight_grad_dtype(weight, n_tokens, chunk_size)
    for start in range(0, n_tokens, chunk_size):
        end = min(start + chunk_size, n_tokens)
        x_chunk = x2[start:end]  # (n, C)
        logits = x_chunk @ weight.T if bias is None else torch.addmm(bias, x_chunk, weight.T)  # (n, V)
        scores, derivative = _transform(logits, scale, softcap)
        grad_logits = chunk_step(scores, labels[start:end], loss_per_token[start:end], None,
                                 ignore_index, compute_grad)  # (n, V), of the summed losses
        if not compute_grad:
            continue
        if scale != 1.0 or softcap:  # back through the soft-cap and the scale, to the logits' dtype
            grad_logits = (grad_logits.mul_(derivative) if derivative is not None
                           else grad_logits.div_(scale)).to(logits.dtype)
        torch.mm(grad_logits, weight, out=grad_x[start:end])
        grad_weight = add_weight_grad(grad_weight, grad_logits, x_chunk, sum_dtype, inplace=True)
        if bias is not None:
            chunk_sum = grad_logits.sum(0, dtype=sum_dtype)
            grad_bias = chunk_sum if grad_bias is None else grad_bias.add_(chunk_sum)
        del logits, scores, derivative, grad_logits
    loss = loss_per_token.sum()
    if reduction == "mean":
        loss = loss / (labels != ignore_index).sum()
    loss = loss.to(_loss_dtype(x, weight, upcast))
    if not compute_grad:
        return loss, grad_x, x.new_empty(0), x.new_empty(0)
    if grad_weight is None:  # no tokens
        grad_weight = torch.zeros(weight.shape, dtype=sum_dtype, device=x.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=sum_dtype, device=x.device)
    return loss, grad_x.view(x.shape), grad_weight, x.new_empty(0) if bias is None else grad_bias


@torch.library.custom_op("picofx::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                            ignore_index: int = -100, reduction: str = "mean", upcast: bool = True,
                            chunk_size: int = DEFAULT_CHUNK_SIZE, compute_grad: bool = True,
                            scale: float = 1.0, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _linear_cross_entropy_chunked(x, weight, bias, labels, ignore_index, reduction, upcast,
                                         chunk_size, compute_grad, cross_entropy_chunk, scale, softcap)


@torch.library.custom_op("picofx::linear_cross_entropy_kernel", mutates_args=())
def linear_cross_entropy_kernel(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                                ignore_index: int, reduction: str, upcast: bool, chunk_size: int,
                                compute_grad: bool, scale: float, softcap: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's kernel without its autograd: what the decomposition leaves to Inductor, as an opaque
    call, on the devices where the kernel is faster than the decomposed ops (CUSTOM_OP_DEVICES)."""
    return linear_cross_entropy_op(x, weight, bias, labels, ignore_index, reduction, upcast, chunk_size,
                                   compute_grad, scale, softcap)


@linear_cross_entropy_op.register_fake
@linear_cross_entropy_kernel.register_fake
def _(x, weight, bias, labels, ignore_index=-100, reduction="mean", upcast=True,
      chunk_size=DEFAULT_CHUNK_SIZE, compute_grad=True, scale=1.0, softcap=0.0):
    _check_args(x, weight, labels, reduction)
    loss = x.new_empty((), dtype=_loss_dtype(x, weight, upcast))
    if not compute_grad:
        return loss, x.new_empty(0), x.new_empty(0), x.new_empty(0)
    sum_dtype = weight_grad_dtype(weight, x.shape[:-1].numel(), chunk_size)
    grad_bias = x.new_empty(0) if bias is None else bias.new_empty(bias.shape, dtype=sum_dtype)
    return loss, x.new_empty(x.shape), weight.new_empty(weight.shape, dtype=sum_dtype), grad_bias


def _setup_context(ctx, inputs, output):
    _, grad_x, grad_weight, grad_bias = output
    x, weight, bias, labels, ignore_index, reduction = inputs[:6]
    ctx.mark_non_differentiable(grad_x, grad_weight, grad_bias)
    ctx.set_materialize_grads(False)  # no zeros for the gradient outputs' own gradients
    ctx.compute_grad, ctx.mean, ctx.ignore_index = inputs[8], reduction == "mean", ignore_index
    ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.save_for_backward(labels, grad_x, grad_weight, grad_bias)


def _backward(ctx, grad_loss, *unused_grads):
    if not ctx.compute_grad:
        raise RuntimeError("picofx::linear_cross_entropy ran with compute_grad=False, so it has no gradients: "
                           "call it with compute_grad=True (or through picofx.kernels.linear_cross_entropy) "
                           "when the loss is differentiated")
    labels, *sums = ctx.saved_tensors
    factor = grad_loss.float()  # 0-dim fp32: the incoming gradient, and the mean's 1 / count
    if ctx.mean:  # with every token ignored the sums are zeros, and stay so (the loss is nan)
        factor = factor / (labels != ctx.ignore_index).sum().clamp_min(1)
    # each sum scaled in fp32 and rounded once to its input's dtype: one pass per gradient
    grads = [(total.float() * factor).to(dtype) if needed else None
             for total, dtype, needed in zip(sums, ctx.dtypes, ctx.needs_input_grad[:3])]
    return (*grads, None, None, None, None, None, None, None, None)


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula([torch.ops.picofx.linear_cross_entropy, torch.ops.picofx.linear_cross_entropy_kernel])
def _linear_cross_entropy_flops(x_shape, weight_shape, *args, compute_grad=True, out_shape=None, **kwargs):
    """The projection matmul, plus the grad_x and grad_weight matmuls the unfused backward has."""
    if len(args) >= 7:
        compute_grad = args[6]
    n_tokens = 1
    for size in x_shape[:-1]:
        n_tokens *= size
    vocab, hidden = weight_shape
    return 2 * n_tokens * hidden * vocab * (3 if compute_grad else 1)


if triton_cross_entropy is not None:
    @linear_cross_entropy_op.register_kernel("cuda")
    def _(x, weight, bias, labels, ignore_index=-100, reduction="mean", upcast=True,
          chunk_size=DEFAULT_CHUNK_SIZE, compute_grad=True, scale=1.0, softcap=0.0):
        # The scale and the soft-cap are applied around the kernel, in torch, on the chunk.
        return _linear_cross_entropy_chunked(x, weight, bias, labels, ignore_index, reduction, upcast,
                                             chunk_size, compute_grad, triton_cross_entropy.cross_entropy_chunk,
                                             scale, softcap)


# Where the decomposition leaves the op's kernel to Inductor as one call. On 2 (shared) CPU cores
# under Inductor, fp32, vocab 32000, hidden 256, chunks of 524 tokens, forward and backward, the
# decomposed loss took 1.20x the op's time at 4096 tokens, 1.11x and 1.05x at 2048 (three runs).
CUSTOM_OP_DEVICES = frozenset({"cpu"})


def linear_cross_entropy_decomposition(x, weight, bias, labels, ignore_index=-100, reduction="mean", upcast=True,
                                       chunk_size=DEFAULT_CHUNK_SIZE, compute_grad=True, scale=1.0, softcap=0.0):
    """The entry of picofx.kernels.inductor_decompositions(): the decomposed op, or on
    CUSTOM_OP_DEVICES one call of its kernel (no autograd: the decomposition applies below it)."""
    args = (x, weight, bias, labels, ignore_index, reduction, upcast, chunk_size, compute_grad, scale, softcap)
    if x.device.type in CUSTOM_OP_DEVICES:
        return torch.ops.picofx.linear_cross_entropy_kernel(*args)
    return linear_cross_entropy_decomposed(*args)


def linear_cross_entropy_decomposed(x, weight, bias, labels, ignore_index=-100, reduction="mean", upcast=True,
                                    chunk_size=DEFAULT_CHUNK_SIZE, compute_grad=True, scale=1.0, softcap=0.0):
    """picofx::linear_cross_entropy in functional ATen ops, the same outputs, chunks unrolled: under
    Inductor the matmuls are its mm and the softmax, gather, mask and casts its fused kernels."""
    _check_args(x, weight, labels, reduction)
    x2, labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)  # (N, C), (N,)
    n_tokens, vocab = x2.shape[0], weight.shape[0]
    sum_dtype = weight_grad_dtype(weight, n_tokens, chunk_size)
    losses, grad_xs, grad_weight, grad_bias = [], [], None, None
    for start in range(0, n_tokens, chunk_size):
        x_chunk, chunk_labels = x2[start:start + chunk_size], labels[start:start + chunk_size]
        logits = x_chunk @ weight.T if bias is None else torch.addmm(bias, x_chunk, weight.T)  # (n, V)
        scores = logits.float() / scale if scale != 1.0 else logits.float()
        if softcap:
            capped = torch.tanh(scores / softcap)
            scores = capped * softcap
        valid = (chunk_labels != ignore_index)[:, None]  # (n, 1)
        safe_labels = torch.where(valid, chunk_labels[:, None], 0)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (n, 1) fp32
        losses.append(torch.where(valid, lse - scores.gather(1, safe_labels), 0.0))
        if not compute_grad:
            continue
        one_hot = torch.arange(vocab, device=x.device) == safe_labels  # (n, V)
        grad = torch.where(valid, torch.exp(scores - lse) - one_hot.float(), 0.0)  # of the summed losses
        if softcap:
            grad = grad * (1.0 - capped * capped)
        grad = (grad / scale if scale != 1.0 else grad).to(logits.dtype)
        grad_xs.append(grad @ weight)  # (n, C)
        grad_weight = add_weight_grad(grad_weight, grad, x_chunk, sum_dtype)
        if bias is not None:
            chunk_sum = grad.sum(0, dtype=sum_dtype)
            grad_bias = chunk_sum if grad_bias is None else grad_bias + chunk_sum
    loss = torch.cat(losses).sum() if losses else x.new_zeros((), dtype=torch.float32)
    if reduction == "mean":
        loss = loss / (labels != ignore_index).sum()
    loss = loss.to(_loss_dtype(x, weight, upcast))
    if not compute_grad:
        return loss, x.new_empty(0), x.new_empty(0), x.new_empty(0)
    if grad_weight is None:  # no tokens
        grad_weight = weight.new_zeros(weight.shape, dtype=sum_dtype)
        grad_bias = None if bias is None else bias.new_zeros(bias.shape, dtype=sum_dtype)
    grad_x = (torch.cat(grad_xs) if len(grad_xs) > 1 else grad_xs[0]) if grad_xs else x2.new_empty(x2.shape)
    return loss, grad_x.view(x.shape), grad_weight, x.new_empty(0) if bias is None else grad_bias


def linear_cross_entropy(x: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, reduction: str = "mean", upcast: bool = True,
                         chunk_size: int = DEFAULT_CHUNK_SIZE, scale: float = 1.0, softcap: float = 0.0) -> Tensor:
    """The loss alone; gradients are computed in the forward only when autograd will want them."""
    compute_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    return torch.ops.picofx.linear_cross_entropy(x, weight, bias, labels, ignore_index, reduction, upcast,
                                                 chunk_size, compute_grad, scale, softcap)[0]
