"""Attention under context parallelism, the ring method: each rank's keys and values travel the
cp ring, one block a step, and each rank's queries attend to every block as it passes; the
partial results are merged by their log-sum-exp.

In the forward graph that runs (picofx::cp_ring_attention, inlined at the partitioned stage by
`lower_ring`), per attention:

    send = all_to_all_single(kv, to the next rank)       # issued before this step's attention
    o, lse = flash_attention(q[rows], k[cols], v[cols])  # the block pairs this step's keys reach
    o, lse = merge((o, lse), earlier)                    # by log-sum-exp
    kv = wait_tensor(send)                               # waited after it: the transfer overlaps it

With the head-tail split (rank r keeps chunks r and 2·cp−1−r), causal masking needs no mask:
at the first step a rank holds its own chunks (two causal diagonal blocks and one full block); a
block from an earlier rank reaches all its queries with its head chunk only, one from a later
rank reaches only its tail queries, both whole (block pairs above the diagonal are skipped). A
mask the model passes is sliced to each block, no block skipped. Only the kv heads travel; the
heads repeat for grouped-query attention inside each block.

The backward (picofx::cp_ring_attention_backward) runs the ring again: the keys and values travel
as in the forward, each block's gradients come from torch's flash-attention backward with the
merged output and log-sum-exp, and the key/value gradients travel with their block, summed at
each rank, back to the rank that owns it: each accumulated block is issued after this step's
block gradients and waited after the next step's.
"""
from __future__ import annotations

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
NEG_INF = float("-inf")


def segments(length: int, load_balance: bool) -> list[tuple[int, int]]:
    """The row (and column) ranges of one rank's tokens that blocks are made of: head and tail."""
    return [(0, length // 2), (length // 2, length)] if load_balance else [(0, length)]


def blocks(step: int, rank: int, ranks: int, length: int, load_balance: bool, causal: bool) -> list[tuple]:
    """(query rows, key columns, causal) of each block pair computed at `step`, holding the keys
    of rank (rank − step) mod ranks; `causal` False: every pair, whole (a mask decides)."""
    whole, (head, tail) = (0, length), segments(length, True)
    if not causal:
        return [(whole, whole, False)]
    source = (rank - step) % ranks
    if not load_balance:
        return [(whole, whole, True)] if source == rank else [(whole, whole, False)] if source < rank else []
    if source == rank:
        return [(head, head, True), (tail, head, False), (tail, tail, True)]
    return [(whole, head, False)] if source < rank else [(tail, whole, False)]


def within(spans, rows: tuple[int, int], x: torch.Tensor):
    """(span, x's part of it) for each span that `x`, holding rows `rows` along dim 2, covers."""
    for start, stop in spans:
        if rows[0] <= start and stop <= rows[1]:
            yield (start, stop), x.narrow(-1 if x.dim() == 3 else 2, start - rows[0], stop - start)


class Pieces:
    """A tensor along dim 2 assembled from per-segment sums (out of place: the code is traced)."""

    def __init__(self, spans, like: torch.Tensor):
        self.spans, self.like, self.parts = spans, like, {s: None for s in spans}

    def add(self, rows, x: torch.Tensor) -> None:
        for span, piece in within(self.spans, rows, x):
            self.parts[span] = piece if self.parts[span] is None else self.parts[span] + piece

    def whole(self) -> torch.Tensor:
        parts = [p if p is not None else self.like.new_zeros(*self.like.shape[:2], stop - start, *self.like.shape[3:])
                 for (start, stop), p in self.parts.items()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def shift(x: torch.Tensor, rank: int, ranks: int, group: str) -> torch.Tensor:
    """Issue: `x` (flat) to the next rank of the ring, the previous rank's in return; wait_tensor it."""
    sent, received = [0] * ranks, [0] * ranks
    sent[(rank + 1) % ranks] = received[(rank - 1) % ranks] = x.numel()
    return c10d.all_to_all_single(x, received, sent, group)


def pack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([a.reshape(-1), b.reshape(-1)])


def unpack(flat: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = like.numel()
    return flat[:n].view(like.shape), flat[n:].view(like.shape)


def laid_out(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`x` with `like`'s memory layout (what the graph's views after it were traced against)."""
    order = sorted(range(like.dim()), key=lambda i: -like.stride(i))
    return x.permute(order).contiguous().permute([order.index(i) for i in range(like.dim())])


def flash_layout(x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, sequence, head_dim) laid out (batch, sequence, heads, head_dim), as the
    attention kernels return it."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def heads_repeated(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def heads_summed(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, t, d = x.shape
    return x if h == kv_heads else x.view(b, kv_heads, h // kv_heads, t, d).sum(2)


def additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros_like(mask, dtype=dtype).masked_fill(mask.logical_not(), NEG_INF)


def mask_block(mask, rows, cols, source: int, length: int):
    """The mask's entries for these query rows and the columns of `source`'s keys (the mask's
    columns are the keys in ring order: rank 0's, then rank 1's...)."""
    if mask is None:
        return None
    if mask.shape[-2] != 1:
        mask = mask.narrow(-2, rows[0], rows[1] - rows[0])
    if mask.shape[-1] != 1:
        mask = mask.narrow(-1, source * length + cols[0], cols[1] - cols[0])
    return mask


def merged(earlier, part):
    """Two attentions of the same queries over disjoint keys, as one: by their log-sum-exp."""
    if earlier is None:
        return part
    (o1, l1), (o2, l2) = earlier, part
    top = torch.maximum(l1, l2)
    top = top.masked_fill(top == NEG_INF, 0.0)
    w1, w2 = (l1 - top).exp(), (l2 - top).exp()
    total = w1 + w2
    out = (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / total.masked_fill(total == 0, 1.0).unsqueeze(-1)
    return out, top + total.log()


def ring_steps(k, v, rank: int, ranks: int, group: str):
    """(step, keys, values, the rank they came from), step by step round the ring: the next step's
    transfer is issued before this step's blocks are handed out and waited when the next step
    begins, so it overlaps this step's attention."""
    flat, sending = pack(k, v), None
    for step in range(ranks):
        if step:
            flat = c10d.wait_tensor(sending)
        if step < ranks - 1:
            sending = shift(flat, rank, ranks, group)
        keys, values = unpack(flat, k)
        yield step, keys, values, (rank - step) % ranks


def gathered_steps(k, v, rank: int, ranks: int):
    """(step, keys, values, the rank they came from) as `ring_steps` yields them, read from keys and
    values already gathered (every rank's, in rank order): nothing travels."""
    length = k.shape[2] // ranks
    for step in range(ranks):
        source = (rank - step) % ranks
        yield step, k.narrow(2, source * length, length), v.narrow(2, source * length, length), source


def attend(q, steps, mask, scale: float, causal: bool, rank: int, ranks: int, load_balance: bool):
    """(out, lse) of this rank's queries over the keys and values `steps` yields, block by block."""
    length, heads = q.shape[2], q.shape[1]
    mask = additive(mask, q.dtype)
    rows = {span: None for span in segments(length, load_balance)}
    for step, keys, values, source in steps:
        for q_rows, k_cols, diagonal in blocks(step, rank, ranks, length, load_balance, causal):
            m = mask_block(mask, q_rows, k_cols, source, length)
            out, lse = FLASH(q.narrow(2, q_rows[0], q_rows[1] - q_rows[0]),
                             heads_repeated(keys.narrow(2, k_cols[0], k_cols[1] - k_cols[0]), heads),
                             heads_repeated(values.narrow(2, k_cols[0], k_cols[1] - k_cols[0]), heads),
                             0.0, diagonal, attn_mask=m, scale=scale)
            if m is not None:  # a row no key of this block reaches: no weight (the kernel gives lse 0)
                lse = lse.masked_fill(~(m > NEG_INF).any(-1).expand_as(lse), NEG_INF)
            for (span, o), (_, l) in zip(within(rows, q_rows, out), within(rows, q_rows, lse)):
                rows[span] = merged(rows[span], (o.float(), l))
    outs = [r[0] for r in rows.values()]
    lses = [r[1] for r in rows.values()]
    out, lse = flash_layout(torch.cat(outs, 2).to(q.dtype)), torch.cat(lses, 2).contiguous()
    return out, lse.masked_fill(lse == NEG_INF, 0.0)  # rows no key reaches: as the kernel leaves them


def step_gradients(grad, q, keys, values, mask, out, lse, dq: "Pieces", scale: float, causal: bool, step: int,
                   source: int, rank: int, ranks: int, load_balance: bool):
    """One step's blocks backward: their query gradients added to `dq`; returns the key and value
    gradients of `source`'s block (kv heads, fp32)."""
    length, heads, kv_heads = q.shape[2], q.shape[1], keys.shape[1]
    spans = segments(length, load_balance)
    dk, dv = Pieces(spans, keys.float()), Pieces(spans, values.float())
    for q_rows, k_cols, diagonal in blocks(step, rank, ranks, length, load_balance, causal):
        r, c = (q_rows[0], q_rows[1] - q_rows[0]), (k_cols[0], k_cols[1] - k_cols[0])
        gq, gk, gv = FLASH_BACKWARD(grad.narrow(2, *r), q.narrow(2, *r),
                                    heads_repeated(keys.narrow(2, *c), heads),
                                    heads_repeated(values.narrow(2, *c), heads), out.narrow(2, *r),
                                    lse.narrow(2, *r), 0.0, diagonal,
                                    attn_mask=mask_block(mask, q_rows, k_cols, source, length), scale=scale)
        dq.add(q_rows, gq.float())
        dk.add(k_cols, heads_summed(gk, kv_heads).float())
        dv.add(k_cols, heads_summed(gv, kv_heads).float())
    return dk.whole(), dv.whole()


def ring_forward(q, k, v, mask, scale: float, causal: bool, rank: int, ranks: int, load_balance: bool,
                 group: str):
    """(out, lse) of this rank's queries over every rank's keys (the module docstring's forward)."""
    return attend(q, ring_steps(k, v, rank, ranks, group), mask, scale, causal, rank, ranks, load_balance)


def ring_backward(grad, q, k, v, mask, out, lse, scale: float, causal: bool, rank: int, ranks: int,
                  load_balance: bool, group: str):
    """(dq, dk, dv): the ring again (the module docstring's backward)."""
    mask, grad = additive(mask, q.dtype), grad.contiguous()
    dq = Pieces(segments(q.shape[2], load_balance), q)
    returning = None
    for step, keys, values, source in ring_steps(k, v, rank, ranks, group):
        gradients = pack(*step_gradients(grad, q, keys, values, mask, out, lse, dq, scale, causal, step, source,
                                         rank, ranks, load_balance))
        if step:  # what the earlier ranks added to this block
            gradients = gradients + c10d.wait_tensor(returning)
        returning = shift(gradients, rank, ranks, group) if ranks > 1 else gradients
    done = c10d.wait_tensor(returning) if ranks > 1 else returning
    dk, dv = unpack(done, k.float())
    return laid_out(dq.whole().to(q.dtype), q), laid_out(dk.to(k.dtype), k), laid_out(dv.to(v.dtype), v)


def gathered_forward(q, k, v, mask, scale: float, causal: bool, rank: int, ranks: int, load_balance: bool):
    """(out, lse) of this rank's queries over the gathered keys and values, block by block as the
    ring computes them: causal masking by skipping and slicing blocks, no mask made."""
    return attend(q, gathered_steps(k, v, rank, ranks), mask, scale, causal, rank, ranks, load_balance)


def gathered_backward(grad, q, k, v, mask, out, lse, scale: float, causal: bool, rank: int, ranks: int,
                      load_balance: bool):
    """(dq, dk, dv) with dk and dv for every rank's keys and values (the gather's backward sums them
    into their owners)."""
    mask, grad = additive(mask, q.dtype), grad.contiguous()
    dq = Pieces(segments(q.shape[2], load_balance), q)
    parts = [None] * ranks
    for step, keys, values, source in gathered_steps(k, v, rank, ranks):
        parts[source] = step_gradients(grad, q, keys, values, mask, out, lse, dq, scale, causal, step, source,
                                       rank, ranks, load_balance)
    dk, dv = (torch.cat([part[i] for part in parts], 2) for i in (0, 1))
    return laid_out(dq.whole().to(q.dtype), q), laid_out(dk.to(k.dtype), k), laid_out(dv.to(v.dtype), v)


@torch.library.custom_op("picofx::cp_ring_attention", mutates_args=())
def cp_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                      causal: bool, rank: int, ranks: int, load_balance: bool,
                      group: str) -> tuple[torch.Tensor, torch.Tensor]:
    return ring_forward(q, k, v, mask, scale, causal, rank, ranks, load_balance, group)


@torch.library.custom_op("picofx::cp_ring_attention_backward", mutates_args=())
def cp_ring_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, scale: float,
                               causal: bool, rank: int, ranks: int, load_balance: bool,
                               group: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = ring_backward(grad, q, k, v, mask, out, lse, scale, causal, rank, ranks, load_balance, group)
    return dq, dk.clone(), dv.clone()  # views of one received buffer: an operator's outputs may not alias


@torch.library.custom_op("picofx::cp_gathered_attention", mutates_args=())
def cp_gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          scale: float, causal: bool, rank: int, ranks: int,
                          load_balance: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return gathered_forward(q, k, v, mask, scale, causal, rank, ranks, load_balance)


@torch.library.custom_op("picofx::cp_gathered_attention_backward", mutates_args=())
def cp_gathered_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, scale: float,
                                   causal: bool, rank: int, ranks: int,
                                   load_balance: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return gathered_backward(grad, q, k, v, mask, out, lse, scale, causal, rank, ranks, load_balance)


def _fake_attention(q, k, v, mask, *options):
    return flash_layout(torch.empty_like(q)), q.new_empty(q.shape[:3], dtype=torch.float32)


def _fake_backward(grad, q, k, v, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, inputs, output):
    q, k, v, mask, *ctx.options = inputs
    ctx.save_for_backward(q, k, v, mask, *output)
    ctx.mark_non_differentiable(output[1])


def _differentiable(forward, backward):
    """`forward`'s gradient through `backward` (the options past the mask get none)."""
    def gradient(ctx, grad, _lse_grad):
        q, k, v, mask, out, lse = ctx.saved_tensors
        return (*backward(grad, q, k, v, mask, out, lse, *ctx.options), None, *[None] * len(ctx.options))

    forward.register_fake(_fake_attention)
    backward.register_fake(_fake_backward)
    forward.register_autograd(gradient, setup_context=_save)


_differentiable(cp_ring_attention, cp_ring_attention_backward)
_differentiable(cp_gathered_attention, cp_gathered_attention_backward)

IMPLEMENTATIONS = {torch.ops.picofx.cp_ring_attention.default: ring_forward,
                   torch.ops.picofx.cp_ring_attention_backward.default: ring_backward,
                   torch.ops.picofx.cp_gathered_attention.default: gathered_forward,
                   torch.ops.picofx.cp_gathered_attention_backward.default: gathered_backward}


def lower_ring(gm: fx.GraphModule, decompositions: dict | None = None) -> int:
    """Each ring or gathered-blocks operator of the graph replaced by its nodes (traced from its
    implementation), so that the issues, waits and attentions are nodes that can be seen and
    scheduled, decomposed by `decompositions` (the compiler's, for the graph is past its
    decomposition). Returns how many were lowered."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        implementation = IMPLEMENTATIONS.get(node.target)
        if implementation is None:
            continue
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        values = [a.meta["val"] for a in tensors]

        def ring(*inputs, args=node.args):
            it = iter(inputs)
            return implementation(*(next(it) if isinstance(a, fx.Node) else a for a in args))

        with detect_fake_mode(values):
            traced = make_fx(ring, decomposition_table=decompositions)(*values)
        copied = dict(zip((n for n in traced.graph.nodes if n.op == "placeholder"), tensors))
        with graph.inserting_before(node):
            for n in traced.graph.nodes:
                if n.op == "call_function":
                    copied[n] = graph.node_copy(n, copied.__getitem__)
        results = [copied[r] for r in traced.graph.output_node().args[0]]
        for user in list(node.users):  # getitem(node, i)
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        count += 1
    return count
