"""Fusion rules for attention: RoPE on q and k as one op (rotate-half, or Meta's complex
multiplication, which rotates neighbouring pairs: the op's interleaved form); attention written as
matmul-softmax-matmul as SDPA; grouped-query attention (k and v repeated per query head before
SDPA) as SDPA with enable_gqa, which reads k and v as they are. The last two compose: eager
attention after repeat_kv becomes SDPA, then SDPA with enable_gqa. After the rules,
`causal_attention` runs each SDPA whose mask is proven causal (picofx.capture.causal states the
rule) with is_causal and no mask."""
import torch
import torch.nn.functional as F
from torch import fx

import picofx.kernels  # noqa: F401  (registers torch.ops.picofx)
from picofx.capture.causal import erase_unread, why_not_causal
from picofx.rewrite import Rule, register_rule, scalar, tensor
from picofx.rewrite.matcher import NearMiss
from picofx.rewrite.rewriter import cycle_reason
from picofx.rewrite.tracing import normalized_args, set_normalized_args
from picofx.capture.vocabulary import VIEW_OPS, module_path

SDPA = torch.ops.aten.scaled_dot_product_attention.default
CAUSAL_ATTENTION = "causal_attention"  # its name among fuse's rules and near-misses
FLOAT_AND_LOW_PRECISION = ({"dtype": torch.float32}, {"dtype": torch.bfloat16})


def rotate_half_by_chunks(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_by_slices(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_pattern(q, k, cos, sin, rotate_half):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_replacement(q, k, cos, sin, rotate_half):
    return torch.ops.picofx.rope(q, k, cos, sin)


def broadcasts_to(small, shape) -> bool:
    try:
        return tuple(torch.broadcast_shapes(small, shape)) == tuple(shape)
    except RuntimeError:
        return False


def cos_sin_broadcast_to_q_and_k(match):
    for table in ("cos", "sin"):
        for name in ("q", "k"):
            table_shape, shape = tuple(match.val(table).shape), tuple(match.val(name).shape)
            if not broadcasts_to(table_shape, shape):
                return f"{table} {table_shape} does not broadcast to {name} {shape}"
    return None


def q_and_k_of_one_attention(match):
    """q and k are two separate chains to the matcher: it also pairs one layer's q with the next
    layer's q or k, which are computed from the first (through its attention). Such a pairing
    would make a cycle; rejecting it here lets the layer's own q and k pair instead."""
    return cycle_reason(match)


def head_dim_is_even(match):
    dim = match.val("q").shape[-1]
    return f"the head dim {dim} is odd: the fused op rotates two equal halves" if dim % 2 else None


def rotate_complex(x, freqs):
    """Meta's form: pairs of channels as complex numbers times e^(i angle), computed in fp32."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (..., D / 2)
    return torch.view_as_real(pairs * freqs).flatten(-2).type_as(x)


def complex_rope_pattern(q, k, freqs_q, freqs_k):
    """freqs_k None: one table node rotates both (torchtitan broadcasts it once for q and k; Meta's
    code indexes it for each), which the matcher needs as a single input."""
    return rotate_complex(q, freqs_q), rotate_complex(k, freqs_q if freqs_k is None else freqs_k)


def complex_rope_replacement(q, k, freqs_q, freqs_k):
    table = torch.view_as_real(freqs_q)  # (..., D / 2, 2): cos, sin
    q_out, k_out = torch.ops.picofx.rope(q.float(), k.float(), table[..., 0], table[..., 1], True)
    return q_out.type_as(q), k_out.type_as(k)


def _viewed_from(node):
    """The tensor `node` views, and the chain of views (op and constant arguments) that gives it."""
    chain = []
    while getattr(node, "target", None) in VIEW_OPS:
        chain.append((node.target, tuple(a for a in node.args[1:])))
        node = node.args[0]
    return node, tuple(chain)


def q_and_k_share_the_table(match):
    if match.bindings.get("freqs_k") is None:
        return None
    q_table, k_table = (_viewed_from(match.bindings[name]) for name in ("freqs_q", "freqs_k"))
    if q_table != k_table:
        return "q and k are rotated by different tables; the fused op rotates both by one"
    return None


def attention_pattern(q, k, v, attn_mask, scale, dropout):
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # (B, H, T, S)
    if attn_mask is not None:
        scores = scores + attn_mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout:  # training mode with p=0, as Hugging Face's eager attention calls it
        probs = F.dropout(probs, p=0.0, training=True)
    return torch.matmul(probs, v)


def attention_replacement(q, k, v, attn_mask, scale, dropout):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def mask_broadcasts_to_the_scores(match):
    if match.bindings.get("attn_mask") is None:
        return None
    mask, scores = match.val("attn_mask").shape, (*match.val("q").shape[:-1], match.val("k").shape[-2])
    return None if broadcasts_to(mask, scores) else f"the mask {tuple(mask)} does not broadcast to the scores {scores}"


def repeat_kv_by_expand(x, n):
    batch, heads, length, dim = x.shape  # (B, Hkv, T, D) -> (B, Hkv * n, T, D)
    return x[:, :, None, :, :].expand(batch, heads, n, length, dim).reshape(batch, heads * n, length, dim)


def repeat_kv_by_interleave(x, n):
    return x.repeat_interleave(n, dim=1)


def repeat_kv_before_transpose(x, n):
    """Meta's form: k and v repeated as (B, T, Hkv, D), then transposed; x is (B, T, Hkv, D)."""
    batch, length, heads, dim = x.shape
    repeated = x[:, :, :, None, :].expand(batch, length, heads, n, dim).reshape(batch, length, heads * n, dim)
    return repeated.transpose(1, 2)


def _kv_heads(x, repeat_kv):
    return x.shape[2] if repeat_kv is repeat_kv_before_transpose else x.shape[1]


def grouped_query_attention_pattern(q, k, v, attn_mask, dropout_p, is_causal, scale, repeat_kv):
    n = q.shape[1] // _kv_heads(k, repeat_kv)  # query heads per key/value head
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=attn_mask,
                                          dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def grouped_query_attention_replacement(q, k, v, attn_mask, dropout_p, is_causal, scale, repeat_kv):
    if repeat_kv is repeat_kv_before_transpose:
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=True)


ROPE = register_rule(Rule(
    name="rope", pattern=rope_pattern, replacement=rope_replacement,
    inputs={"q": tensor(2, 8, 4, 16), "k": tensor(2, 8, 2, 16), "cos": tensor(8, 1, 16), "sin": tensor(8, 1, 16),
            "rotate_half": rotate_half_by_chunks},
    variants=({"rotate_half": rotate_half_by_chunks}, {"rotate_half": rotate_half_by_slices}),
    checks=(q_and_k_of_one_attention, cos_sin_broadcast_to_q_and_k, head_dim_is_even),
))

COMPLEX_ROPE = register_rule(Rule(
    name="complex_rope", pattern=complex_rope_pattern, replacement=complex_rope_replacement,
    inputs={"q": tensor(2, 8, 4, 16), "k": tensor(2, 8, 2, 16), "freqs_q": tensor(1, 8, 1, 8, dtype=torch.complex64),
            "freqs_k": tensor(1, 8, 1, 8, dtype=torch.complex64)},
    variants=[{**v, **shared} for v in FLOAT_AND_LOW_PRECISION for shared in ({}, {"freqs_k": None})],
    checks=(q_and_k_of_one_attention, q_and_k_share_the_table),
    # torch's complex product and the op's real arithmetic round alike up to FMA contraction.
    tolerance=(1e-5, 1e-5), tolerance_reason="the complex product may contract a multiply-add where the op does not",
))

ATTENTION = register_rule(Rule(
    name="attention", pattern=attention_pattern, replacement=attention_replacement,
    inputs={"q": tensor(2, 4, 8, 16), "k": tensor(2, 4, 8, 16), "v": tensor(2, 4, 8, 16), "attn_mask": None,
            "scale": scalar(0.0789), "dropout": False},
    # q as a projection's (B, T, H, D) output transposed, or contiguous (e.g. from the rope op); an
    # additive mask or none; the p=0 dropout of training mode or none; fp32 or bf16.
    variants=[{"q": tensor(2, 4, 8, 16, stored_as=layout), "attn_mask": mask, "dropout": dropout, "dtype": dtype}
              for layout in (None, (0, 2, 1, 3)) for mask in (None, tensor(2, 1, 8, 8))
              for dropout in (False, True) for dtype in (torch.float32, torch.bfloat16)],
    checks=(mask_broadcasts_to_the_scores,),
    # SDPA's kernel computes the softmax block by block with a running maximum: other rounding.
    tolerance=(1e-5, 1e-5), tolerance_reason="SDPA computes the softmax blockwise, in another order",
))

GROUPED_QUERY_ATTENTION = register_rule(Rule(
    name="grouped_query_attention", pattern=grouped_query_attention_pattern,
    replacement=grouped_query_attention_replacement,
    inputs={"q": tensor(2, 4, 8, 16), "k": tensor(2, 2, 8, 16), "v": tensor(2, 2, 8, 16), "attn_mask": None,
            "dropout_p": scalar(0.0123), "is_causal": True, "scale": scalar(0.0456, optional=True),
            "repeat_kv": repeat_kv_by_expand},
    # An explicit mask (Hugging Face's) or is_causal (SDPA's own); repeat_interleave or expand + reshape.
    variants=[{"attn_mask": mask, "is_causal": causal, "repeat_kv": repeat}
              for mask, causal in ((None, True), (None, False), (tensor(2, 1, 8, 8, dtype=torch.bool), False))
              for repeat in (repeat_kv_by_expand, repeat_kv_by_interleave)]
    + [{"k": tensor(2, 8, 2, 16), "v": tensor(2, 8, 2, 16), "repeat_kv": repeat_kv_before_transpose}],
    # The forward is the same; the backward sums the gradients of the query heads that share a k/v
    # head inside the kernel instead of through repeat's backward: another order.
    tolerance=(1e-5, 1e-5), tolerance_reason="k and v gradients are summed over their query heads in another order",
))


def causal_attention(graph: fx.Graph) -> tuple[int, list[NearMiss]]:
    """Each SDPA under a mask proven causal as SDPA with is_causal=True and no mask (flash attention
    then skips the masked half; with enable_gqa CUDA has fused kernels only without a mask), the
    mask's computation erased once nothing reads it. Not a pattern rule: a mask is evaluated once for all the layers
    that read it. Returns how many it made causal, and why each other masked SDPA stays masked."""
    verdicts: dict[fx.Node, str | None] = {}
    made, masks, missed = 0, [], []
    for node in graph.find_nodes(op="call_function", target=SDPA):
        args = normalized_args(node)  # query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        mask = args[3]
        if not isinstance(mask, fx.Node):
            continue
        reason = scores_reason(node, mask)
        if reason is None:
            if mask not in verdicts:
                verdicts[mask] = why_not_causal(mask)
            reason = verdicts[mask]
        if reason is not None:
            where = f"{node.name} in {module_path(node)}" if module_path(node) else node.name
            missed.append(NearMiss(CAUSAL_ATTENTION, where, "mask_is_causal", reason))
            continue
        args[3], args[5] = None, True
        set_normalized_args(node, args)
        made += 1
        masks.append(mask)
    erase_unread(graph, masks)
    return made, missed


def scores_reason(attention: fx.Node, mask: fx.Node) -> str | None:
    """Why SDPA's is_causal could not stand for this mask whatever its values: is_causal is the
    top-left tril of the (T x S) scores, equal to a causal mask only where T == S and the mask
    covers them (a (1, 1) mask broadcast would mask nothing)."""
    query, key = (attention.args[i].meta["val"].shape for i in (0, 1))
    shape = tuple(mask.meta["val"].shape)
    if query[-2] != key[-2] or shape[-2:] != (query[-2], key[-2]):
        return f"the mask {shape} is not the square ({query[-2]} x {key[-2]}) scores"
    return None
