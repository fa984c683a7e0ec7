"""What each gloo rank runs for tests/passes/test_context_parallel.py: every rank of the cp group is
called with the same whole batch; results go back to the test process, which compares them."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import picofx
from picofx.models import real_models, zoo
from picofx.passes import ContextParallel

SDPA = torch.ops.aten.scaled_dot_product_attention.default
GATHER = torch.ops.picofx.sp_gather.default
RING = torch.ops.picofx.cp_ring_attention.default
BLOCKWISE = torch.ops.picofx.cp_gathered_attention.default
ATTENTIONS = {"forward": torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              "backward": torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
TRANSFER = torch.ops._c10d_functional.all_to_all_single.default

# (model builder, ContextParallel's options) per case; the test builds the same models in one process
MODELS = {"reference": ("llama-tiny", {}), "reference unbalanced": ("llama-tiny", {"load_balance": False}),
          "hf": ("hf llama", {}), "hf unbalanced": ("hf llama", {"load_balance": False}),
          "qwen2": ("hf qwen2", {}), "gpt2": ("gpt2-tiny", {}), "titan": ("titan llama3", {}),
          "hf left-padded": ("hf llama padded", {}),
          "reference ring": ("llama-tiny", {"method": "ring"}),
          "reference ring unbalanced": ("llama-tiny", {"method": "ring", "load_balance": False}),
          "hf left-padded ring": ("hf llama padded", {"method": "ring"}),
          "qwen2 ring": ("hf qwen2", {"method": "ring"}), "titan ring": ("titan llama3", {"method": "ring"})}
# on 4 ranks (slow): the ring on every model, with and without load balance, beside the all-gather
FOUR_RANKS = {f"{case}{tag}{suffix}": (name, {"method": method, **extra})
              for case, name in (("reference", "llama-tiny"), ("hf", "hf llama"), ("hf left-padded", "hf llama padded"),
                                 ("qwen2", "hf qwen2"), ("titan", "titan llama3"))
              for method, tag in (("ring", " ring"), ("allgather", ""))
              for suffix, extra in (("", {}), (" unbalanced", {"load_balance": False}))
              if method == "ring" or case == "reference"}


def build(name: str, **kwargs) -> zoo.ZooModel:
    if name == "hf llama padded":  # the first sequence's first 3 tokens are padding: its mask, split too
        z = real_models.hf_model("llama", **kwargs)
        ids = z.example_inputs["input_ids"]
        mask, labels = torch.ones_like(ids), ids.clone()
        mask[0, :3], labels[0, :3] = 0, -100
        z.example_inputs.update(attention_mask=mask, labels=labels)
        return z
    if name.startswith("hf "):
        return real_models.hf_model(name[3:], **kwargs)
    if name == "titan llama3":
        return real_models.build("torchtitan-llama3", **kwargs)
    return zoo.build(name, **kwargs)


def one_step(z: zoo.ZooModel, backend: str = "eager", others=(), **options) -> dict:
    opt = picofx.optimize(z.model, z.example_inputs, [ContextParallel(**options), *others], backend=backend,
                          loss_fn=z.loss_fn)
    out = opt(**dict(z.example_inputs))
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    graph = opt.graph_module.graph
    attentions = [n for n in graph.nodes if n.target in (SDPA, BLOCKWISE)]
    return {"loss": loss.detach(), "grads": {n: p.grad.detach().clone() for n, p in z.model.named_parameters()},
            "logits": None if isinstance(out, torch.Tensor) else out.logits.detach(),
            "queries": [tuple(n.args[0].meta["val"].shape) for n in attentions],
            "keys": [tuple(n.args[1].meta["val"].shape) for n in attentions],
            "masks": [n.kwargs.get("attn_mask") is not None for n in attentions if n.target is SDPA],
            "gathered": [tuple(n.meta["val"].shape) for n in graph.nodes if n.target is GATHER],
            "collectives": {role: sorted(n.target.__name__ for n in opt.graphs[role].graph.nodes
                                         if getattr(n.target, "namespace", None) in ("_c10d_functional", "picofx"))
                            for role in ("forward", "backward")},
            "rings": [tuple(tuple(a.meta["val"].shape) for a in n.args[:3]) for n in graph.nodes if n.target is RING],
            "transfers": {role: transfers(opt.graphs[role].graph, ATTENTIONS[role]) for role in ATTENTIONS},
            "notes": next(r.notes for r in opt.report.records if r.name == "context_parallel")}


def transfers(graph, attention) -> list[int]:
    """For each ring transfer (issue) of `graph`, in order: how many attentions run after its
    issue and before its wait."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    found = []
    for issue in (n for n in graph.nodes if n.target is TRANSFER):
        wait = min(issue.users, key=order.__getitem__)
        found.append(sum(1 for n in graph.nodes if n.target is attention and order[issue] < order[n] < order[wait]))
    return found


class ScoresAttention(nn.Module):
    """One causal attention written as matmuls and a softmax (no scaled_dot_product_attention)."""

    def __init__(self, vocab: int = 64, width: int = 16, mask_from_tokens: bool = False):
        super().__init__()
        self.embed, self.qkv, self.head = nn.Embedding(vocab, width), nn.Linear(width, 3 * width), nn.Linear(width, vocab)
        self.mask_from_tokens = mask_from_tokens

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # (B, 1, T, width)
        if self.mask_from_tokens:  # a mask computed from the hidden states: which keys are "loud"
            mask = (k.sum(-1, keepdim=True) > 0).transpose(-1, -2).expand(-1, -1, q.shape[2], -1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | torch.eye(q.shape[2], dtype=torch.bool))
        else:
            scores = (q @ k.transpose(-1, -2)).masked_fill(
                torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1), float("-inf"))
            y = scores.softmax(-1) @ v
        logits = self.head(y.squeeze(1))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def refusal(model: nn.Module, inputs: dict, loss_fn=None, **options) -> str:
    """The error optimize raises for this model (every rank raises it alone: no collective has run)."""
    try:
        picofx.optimize(model, inputs, [ContextParallel(**options)], backend="eager", loss_fn=loss_fn)
    except Exception as e:  # noqa: BLE001  (the message is what the test reads)
        return str(e)
    return "no error"


def odd(seq: int) -> tuple:
    z = zoo.build("llama-tiny", seq=seq)
    return z.model, z.example_inputs, z.loss_fn


def scenarios(rank: int, world: int) -> dict:
    out = {}
    for case, (name, options) in MODELS.items():
        torch.manual_seed(0)
        out[case] = one_step(build(name), **options)
    torch.manual_seed(0)
    out["fuse"] = one_step(build("llama-tiny"), others=["fuse"])
    ids = torch.randint(0, 64, (2, 12))
    out["refused"] = {
        "sequence": refusal(*odd(30)),
        "sequence unbalanced": refusal(*odd(31), load_balance=False),
        "no attention": refusal(ScoresAttention(), {"input_ids": ids, "labels": ids}),
        "mask": refusal(ScoresAttention(mask_from_tokens=True), {"input_ids": ids, "labels": ids}),
        "ring mask": refusal(ScoresAttention(mask_from_tokens=True), {"input_ids": ids, "labels": ids},
                             method="ring"),
    }
    return out


def four_ranks(rank: int, world: int) -> dict:
    out = {}
    for case, (name, options) in FOUR_RANKS.items():
        torch.manual_seed(0)
        result = one_step(build(name), **options)
        out[case] = {k: result[k] for k in ("loss", "grads", "logits", "transfers", "rings")}
    return out


def inductor(rank: int, world: int) -> dict:
    out = {}
    for method in ("allgather", "ring"):
        torch.manual_seed(0)
        out[method] = one_step(build("llama-tiny"), backend="inductor", method=method)
    return out


TRAIN = ["--backend", "eager", "--passes", "--batch", "2", "--seq", "16", "--log-every", "1", "--steps", "3"]


def trained_with_cp(rank: int, world: int) -> list:
    """picofx train --cp 2 on this rank of the harness's group: its losses."""
    import importlib
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    return importlib.import_module("picofx.cli.train").main([*TRAIN, "--cp", str(world)])["losses"]
