"""Every way real code writes the causal-LM loss, through `fuse`: the fused projection + loss
replaces it (loss and every gradient equal eager), or, where the fused op computes something else
(label smoothing, class or per-token weights), the loss stays as written and explain says why."""
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from picofx.models import zoo
from picofx.models.zoo import ZooModel, token_batch
from picofx.cost.device import H200
from picofx.cost.model import CostModel
from picofx.passes.fuse.fuse import Fuse
from picofx.passes.fuse.loss import CPU_CHUNKING, chunking_for
from picofx.passes.fuse.sites import KINDS, census
from picofx.rewrite import registered_rules
from picofx.testing import assert_trains_like_eager, captured, count_ops, run_pass

aten, picofx_ops = torch.ops.aten, torch.ops.picofx
VOCAB, HIDDEN, BATCH, SEQ = 96, 32, 2, 8
FP32 = (1e-5, 1e-5)  # the loss rule's declared tolerance: the fused loss sums chunk by chunk


def seed_form(logits, labels):  # the seed framework: F.cross_entropy(logits.view(B * T, -1), targets.reshape(-1))
    batch, seq = labels.shape
    return F.cross_entropy(logits.view(batch * seq, -1), labels.reshape(-1))


def view_last(logits, labels):
    return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def flatten_tokens(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def reshape_last(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def upcast(logits, labels):
    return F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1))


def custom_ignore_index(logits, labels):
    return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-1)


def summed(logits, labels):
    return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), reduction="sum")


def hf_shifted_labels(logits, labels):  # as transformers shifts: pad with ignore_index, drop the first
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return F.cross_entropy(logits.float().view(-1, VOCAB), shifted.view(-1))


def shifted_logits(logits, labels):  # older scripts: drop the last position of the logits instead
    shift_logits = logits[..., :-1, :].contiguous()
    return F.cross_entropy(shift_logits.view(-1, VOCAB), labels[..., 1:].contiguous().view(-1))


def hf_loss_function(logits, labels):  # the model's own loss_function (LlamaForCausalLM.loss_function)
    return ForCausalLMLoss(logits, labels, vocab_size=VOCAB)


def hf_loss_function_over_items(logits, labels):  # the Trainer's gradient accumulation: sum / items
    items = (labels[..., 1:] != -100).sum()
    return ForCausalLMLoss(logits, labels, vocab_size=VOCAB, num_items_in_batch=items)


def label_smoothing(logits, labels):
    return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), label_smoothing=0.1)


def class_weights(logits, labels):
    weight = torch.linspace(0.5, 1.5, VOCAB, device=logits.device)
    return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), weight=weight)


def per_token_weights(logits, labels):
    losses = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), reduction="none")  # (B * T,)
    weights = torch.linspace(0.0, 1.0, losses.numel(), device=losses.device)
    return (losses * weights).sum() / weights.sum()


class LanguageModel(nn.Module):
    """Embedding, one hidden layer and the head: the loss is the only fusible site."""

    def __init__(self, loss):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.hidden = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.loss = loss

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.hidden(self.embed(input_ids))))  # (B, T, V)
        return self.loss(logits, labels)


def language_model(loss, ignore_index=-100):
    torch.manual_seed(0)
    ids = token_batch(VOCAB, BATCH, SEQ, seed=0)
    labels = ids.clone()
    labels[0, :3] = ignore_index  # some ignored tokens (the default -100 for most forms)
    return ZooModel(LanguageModel(loss), {"input_ids": ids, "labels": labels}, None)


def fused_loss_arguments(gm) -> dict:
    """The fused loss op's arguments by name, defaults filled in."""
    (node,) = [n for n in gm.graph.nodes if n.target is picofx_ops.linear_cross_entropy.default]
    schema = node.target._schema.arguments
    given = {**dict(zip((a.name for a in schema), node.args)), **node.kwargs}
    return {a.name: given.get(a.name, a.default_value) for a in schema}


FUSED_FORMS = {
    "seed view(B * T, -1)": (seed_form, -100), "view(-1, V)": (view_last, -100),
    "flatten(0, 1)": (flatten_tokens, -100), "reshape": (reshape_last, -100), ".float()": (upcast, -100),
    "ignore_index=-1": (custom_ignore_index, -1), "reduction=sum": (summed, -100),
    "HF shifted labels": (hf_shifted_labels, -100), "shifted logits": (shifted_logits, -100),
    "HF loss_function": (hf_loss_function, -100), "HF loss_function over items": (hf_loss_function_over_items, -100),
}


@pytest.mark.parametrize("form", FUSED_FORMS)
def test_loss_form_is_fused_and_trains_like_eager(form):
    loss, ignore_index = FUSED_FORMS[form]
    opt = assert_trains_like_eager(language_model(loss, ignore_index), [Fuse(explain=True)], tolerance=FP32)
    gm = opt.graph_module
    assert count_ops(gm, picofx_ops.linear_cross_entropy.default) == 1
    assert count_ops(gm, aten._log_softmax.default, aten.linear.default) == 1  # the hidden layer's linear
    assert fused_loss_arguments(gm)["ignore_index"] == ignore_index
    assert census(gm.graph)["loss"] == {"fused": 1, "unfused": 0, "not_fusible": 0}


def test_bf16_logits_upcast_for_the_loss_are_fused():
    zoo_model = language_model(hf_shifted_labels)
    zoo_model.model.to(torch.bfloat16)
    # bf16 logits and gradients round once per chunk in the fused op, per op unfused: bf16's ulp.
    opt = assert_trains_like_eager(zoo_model, [Fuse()], tolerance=(2e-2, 1e-3))
    assert fused_loss_arguments(opt.graph_module)["upcast"] is True  # the loss in fp32, as .float() asked


LEFT_ALONE = {
    "label smoothing": (label_smoothing, "label smoothing"),
    "class weights": (class_weights, "class weights"),
    "per-token weights": (per_token_weights, "per-token losses"),
}


@pytest.mark.parametrize("form", LEFT_ALONE)
def test_loss_form_the_fused_op_does_not_compute_is_left_alone_with_a_reason(form):
    loss, reason = LEFT_ALONE[form]
    opt = assert_trains_like_eager(language_model(loss), [Fuse(explain=True)])
    gm = opt.graph_module
    assert count_ops(gm, picofx_ops.linear_cross_entropy.default) == 0
    assert census(gm.graph)["loss"] == {"fused": 0, "unfused": 0, "not_fusible": 1}
    notes = next(r.notes for r in opt.report.records if r.name == "fuse")
    (line,) = notes["unfused_sites"]
    assert line.startswith("loss at _log_softmax") and f"not fusible: {reason}" in line, line


def test_gpt2_is_left_alone_by_the_llama_rules():
    """LayerNorm, GELU, learned positions, one c_attn projection, SDPA without repeated heads: only
    the generic projection + loss rule applies."""
    zoo_model = zoo.gpt2(seq=16)
    opt = assert_trains_like_eager(zoo_model, [Fuse(explain=True)], tolerance=FP32)
    notes = next(r.notes for r in opt.report.records if r.name == "fuse")
    assert {rule.name: notes[rule.name] for rule in registered_rules() if notes[rule.name]} == \
        {"linear_cross_entropy": 1}
    assert notes["near_misses"] == [] and notes["unfused_sites"] == []
    after = census(opt.graph_module.graph)
    assert {kind: after[kind]["fused"] for kind in KINDS} == {"norm": 0, "gated_mlp": 0, "rope": 0, "attention": 0,
                                                              "loss": 1}


@pytest.fixture(scope="module")
def tiny_llama():
    return captured(zoo.build("llama-tiny"))  # 64 tokens, vocab 256: 64 KiB of fp32 logits


def fused_loss_chunk(tiny_llama, device: str, memory_capacity: int | None):
    """The fused loss's chunk size and the pass's note when fuse runs for `device` with that much memory."""
    gm, ctx = copy.deepcopy(tiny_llama[0]), tiny_llama[1]
    described = CostModel(dataclasses.replace(H200, memory_capacity=memory_capacity)) if memory_capacity else None
    record = run_pass(Fuse(rules=("linear_cross_entropy",)), gm, dataclasses.replace(
        ctx, device=torch.device(device), cost_model=described))
    (node,) = gm.graph.find_nodes(op="call_function", target=picofx_ops.linear_cross_entropy.default)
    return node.args[7], record.notes["loss_chunks"]


def test_the_loss_chunks_come_from_the_device_memory(tiny_llama):
    chunk, notes = fused_loss_chunk(tiny_llama, "cuda", 141 * 10**9)  # the logits fit: one chunk
    assert chunk == 64 and notes[0].startswith("linear_cross_entropy: 1 chunk of 64 tokens")
    chunk, notes = fused_loss_chunk(tiny_llama, "cuda", 16 * 16 * 1024)  # a sixteenth is 16 KiB: 16 tokens of logits
    assert chunk == 16 and "4 chunks of 16 tokens" in notes[0] and "1/16 of its" in notes[0]
    chunk, notes = fused_loss_chunk(tiny_llama, "cpu", None)  # at least 512 tokens a chunk, so all 64 at once
    assert chunk == 64 and notes[0].endswith(CPU_CHUNKING.why)


def test_llama_1b_loss_is_one_chunk_on_an_h200_and_sixteen_on_cpu():
    tokens, vocab = 4 * 2048, 128_256  # 4.2 GB of fp32 logits
    assert chunking_for("cuda", H200.memory_capacity).chunk_size(vocab, tokens) == tokens
    assert chunking_for("cuda", 40 * 2**30).chunk_size(vocab, tokens) == 4096  # 2.5 GiB a chunk: 2 equal chunks
    assert chunking_for("cpu").chunk_size(vocab, tokens) == 512
