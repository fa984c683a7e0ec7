"""Pass `precision` in training: backward casts, master weights, gradients and losses against fp32
and torch.autocast, fp16 loss scaling, composition with `fuse`, Inductor."""
import collections
import copy

import pytest
import torch
from torch.utils._pytree import tree_leaves
from precision_models import BF16, FP16, FP32, calls, dtype, float_casts, float_inputs, model_loss, relative_errors

import picofx
from picofx.models import zoo
from picofx.models.llama import Llama, LlamaConfig, causal_lm_loss
from picofx.passes import Precision
from picofx.passes.precision.casts import is_plain_cast
from picofx.passes.precision.rules import op_name
from picofx.testing import markov_batches, train_losses


def test_backward_reuses_the_forward_weight_casts_and_master_weights_stay_fp32():
    z = zoo.build("llama-tiny")
    opt = picofx.optimize(z.model, z.example_inputs, ["precision"], backend="eager", loss_fn=z.loss_fn)
    forward, backward = opt.graphs["forward"], opt.graphs["backward"]
    weight_casts = [src.name for src, d in float_casts(forward) if src.op == "placeholder"]
    assert len(weight_casts) == len(set(weight_casts)) == 15
    # The backward takes the forward's bf16 weights as saved values; it never casts an fp32 input down.
    assert not [src for src, d in float_casts(backward) if src.op == "placeholder" and d == BF16]
    optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-3)
    opt(**z.example_inputs).backward()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if t.is_floating_point()]
    assert {p.dtype for p in z.model.parameters()} | {p.grad.dtype for p in z.model.parameters()} == {FP32}
    assert {t.dtype for t in state} == {FP32}


@pytest.mark.parametrize("name", ["llama-tiny", "hf-llama-tiny"])
def test_gradients_close_to_fp32_like_autocast(name):
    z = zoo.build(name)
    plain, autocast_model = copy.deepcopy(z.model), copy.deepcopy(z.model)
    opt = picofx.optimize(z.model, z.example_inputs, [Precision()], backend="eager", loss_fn=z.loss_fn)
    batch = z.example_inputs
    expected = model_loss(z, plain, batch)
    with torch.autocast("cpu", BF16):
        autocast_loss = model_loss(z, autocast_model, batch)
    loss = opt(**batch) if z.loss_fn is not None else opt(**batch).loss
    for value in (expected, autocast_loss, loss):
        value.backward()
    assert abs(loss.item() - expected.item()) < 1e-3 * expected.item()
    reference = [p.grad for p in plain.parameters()]
    ours = max(relative_errors([p.grad for p in z.model.parameters()], reference))
    theirs = max(relative_errors([p.grad for p in autocast_model.parameters()], reference))
    assert ours < 2e-2 and ours < 1.5 * theirs, (ours, theirs)


@pytest.mark.slow
def test_150_adamw_steps_end_within_2_percent_of_fp32():
    """The issue's check: tiny reference LLaMA, 150 AdamW steps; final loss = mean of the last 10."""
    z = zoo.reference_llama("tiny", batch=8, seq=32)
    batches = markov_batches(256, 8, 32, 150)
    final = {}
    for mode in ("fp32", "precision", "autocast"):
        model = copy.deepcopy(z.model)
        if mode == "precision":
            opt = picofx.optimize(model, batches[0], ["precision"], backend="eager", loss_fn=z.loss_fn)
            step = lambda b: opt(**b)  # noqa: E731
        else:
            def step(b, model=model, enabled=mode == "autocast"):
                with torch.autocast("cpu", BF16, enabled=enabled):
                    return z.loss_fn(model(b["input_ids"]), b["labels"])
        losses = train_losses(step, model.parameters(), batches)
        final[mode] = sum(losses[-10:]) / 10
    deviation = {mode: (final[mode] - final["fp32"]) / final["fp32"] for mode in ("precision", "autocast")}
    figures = (f"150 steps: final loss fp32 {final['fp32']:.4f}, precision {final['precision']:.4f} "
               f"({deviation['precision']:+.2%}), autocast {final['autocast']:.4f} ({deviation['autocast']:+.2%})")
    assert final["fp32"] < 2.5, figures  # it learned (from log(256) = 5.55); the comparison means something
    assert abs(deviation["precision"]) < 0.02, figures


def test_fp16_overflowing_steps_are_skipped_and_training_recovers():
    z = zoo.reference_llama("tiny", batch=8, seq=32)
    batches = markov_batches(256, 8, 32, 30)
    # 2**24 overflows fp16 in the backward (the logits' gradient alone is ~scale / tokens), so the
    # first steps overflow; the scaler backs off until the gradients fit, then training proceeds.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    opt = picofx.optimize(z.model, batches[0], [Precision(dtype="fp16", loss_scale=scaler)], backend="eager",
                          loss_fn=z.loss_fn)
    assert {dtype(n) for n in calls(opt.graph_module, "matmul", "attention")} == {FP16}
    optimizer = torch.optim.AdamW(z.model.parameters(), lr=1e-2)
    skipped, losses = [], []
    for batch in batches:
        before = [p.detach().clone() for p in z.model.parameters()]
        scale = scaler.get_scale()
        loss = opt(**batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
        unchanged = all(torch.equal(a, p) for a, p in zip(before, z.model.parameters()))
        assert unchanged == (scaler.get_scale() < scale)  # a step is skipped exactly when the scale backs off
        skipped.append(unchanged)
    assert skipped[0] and not all(skipped[-10:]), skipped
    steps_taken = optimizer.state[next(z.model.parameters())]["step"].item()
    assert steps_taken == skipped.count(False)
    assert {p.dtype for p in z.model.parameters()} == {FP32} and all(p.isfinite().all() for p in z.model.parameters())
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses


# ---- composition and Inductor ----------------------------------------------------------------

def test_composes_with_fuse():
    z = zoo.build("llama-tiny")
    reference, autocast_model = copy.deepcopy(z.model), copy.deepcopy(z.model)
    opt = picofx.optimize(z.model, z.example_inputs, ["fuse", "precision"], backend="eager", loss_fn=z.loss_fn)
    gm = opt.graph_module
    fused = [n for n in gm.graph.nodes if (op_name(n.target) or "").startswith("picofx.")]
    assert fused, "fuse rewrote nothing"
    # Every block still fused after precision: the first norm alone, then each norm after a residual add.
    layers = len(z.model.decoder_layers)
    assert collections.Counter(op_name(n.target) for n in fused) == {
        "picofx.rms_norm": 1, "picofx.add_rms_norm": 2 * layers, "picofx.rope": layers, "picofx.silu_mul": layers,
        "picofx.linear_cross_entropy": 1}
    for node in calls(gm, "matmul", "attention", "fused"):
        assert {dtype(a) for a in float_inputs(node)} == {BF16}, node.format_node()
    for node in calls(gm, "fused_norms"):  # the fp32 stream and weight as they come, as autocast's norm reads them
        assert not any(is_plain_cast(a) for a in node.all_input_nodes), node.format_node()
        weight_at = 2 if node.target is torch.ops.picofx.add_rms_norm.default else 1
        stream, weight = node.args[:weight_at], node.args[weight_at]
        assert dtype(weight) == FP32 and FP32 in {dtype(a) for a in stream}, node.format_node()
        assert tree_leaves(node.meta["val"])[-1].dtype == BF16, node.format_node()
    loss_node = next(n for n in fused if op_name(n.target) == "picofx.linear_cross_entropy")
    assert loss_node.meta["val"][0].dtype == FP32
    loss = opt(**z.example_inputs)
    expected = model_loss(z, reference, z.example_inputs)
    with torch.autocast("cpu", BF16):
        autocast_loss = model_loss(z, autocast_model, z.example_inputs)
    loss.backward()
    expected.backward()
    assert abs(loss.item() - expected.item()) < 1e-3 * expected.item()
    # Norms fed a bf16-rounded stream put the loss 4e-5 off autocast's; computed as autocast does, 1e-7.
    assert abs(loss.item() - autocast_loss.item()) < 1e-6 * autocast_loss.item()
    errors = relative_errors([p.grad for p in z.model.parameters()], [p.grad for p in reference.parameters()])
    assert max(errors) < 2e-2


@pytest.mark.slow
def test_inductor_step_matches_eager_and_keeps_one_cast_per_weight():
    torch.manual_seed(0)
    one_layer = zoo.ZooModel(Llama(LlamaConfig(num_hidden_layers=1)), zoo.reference_llama().example_inputs,
                             causal_lm_loss)  # one layer: Inductor compiles half the kernels
    eager_model = copy.deepcopy(one_layer.model)
    opt = picofx.optimize(one_layer.model, one_layer.example_inputs, ["precision"], backend="inductor",
                          loss_fn=causal_lm_loss)
    eager = picofx.optimize(eager_model, one_layer.example_inputs, ["precision"], backend="eager",
                            loss_fn=causal_lm_loss)
    # Inductor's min-cut partitioner could recompute casts in the backward; it must save the bf16 weights.
    assert not [src for src, d in float_casts(opt.graphs["backward"]) if src.op == "placeholder" and d == BF16]
    loss, expected = opt(**one_layer.example_inputs), eager(**one_layer.example_inputs)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-3, atol=1e-3)
    assert max(relative_errors([p.grad for p in one_layer.model.parameters()],
                               [p.grad for p in eager_model.parameters()])) < 2e-2
