"""torchtitan's Llama 3 (picofx.models.titan_llama: complex RoPE through a `freqs_cis` buffer,
grouped-query attention, its own RMSNorm and FeedForward) through every pass combination that runs
in one process: the loss and every gradient equal eager, and fuse leaves no fusible site: RoPE
becomes the interleaved rope op in each layer, beside the norms, SwiGLU, SDPA with grouped-query
heads and the fused loss."""
import pytest
import torch

import picofx
from picofx.models import real_models
from picofx.models.titan_llama import ModelArgs
from picofx.passes.checkpoint.checkpoint import Checkpoint
from picofx.passes.fuse.fuse import Fuse
from picofx.passes.fuse.sites import KINDS, census
from picofx.passes.precision.precision import TOLERANCE, Precision
from picofx.testing import captured, count_ops, run_pass

picofx_ops, aten = torch.ops.picofx, torch.ops.aten
NAME = "torchtitan-llama3"
LAYERS = ModelArgs().n_layers
# norm (2 per layer + the final one), gated MLP, rope, attention (one each per layer), loss
FUSED = (2 * LAYERS + 1, LAYERS, LAYERS, LAYERS, 1)
FP32 = (1e-5, 1e-5)  # what the fuse rules declare: sums (and the complex product) in another order
# passes=[] runs capture's ATen decompositions, which round differently from eager's kernels
# (silu as x * sigmoid(x), cross-entropy as log_softmax, gather, sum / count): a few fp32 ulps.
BASELINE = (1e-5, 1e-6)
# precision rounds every matmul input to bf16: ~1% of each gradient's norm (picofx.passes.precision.precision)
BF16 = TOLERANCE[torch.bfloat16]
BUDGET = 0.97  # of the peak without checkpointing: between it and the smallest reachable (~0.96)
COMBINATIONS = {
    "none": ([], BASELINE, False),
    "fuse": ([Fuse()], FP32, False),
    "precision": ([Precision()], BF16, True),
    "fuse+precision": ([Fuse(), Precision()], BF16, True),
    "checkpoint": ([Checkpoint(budget=BUDGET)], BASELINE, False),
    "fuse+precision+checkpoint": ([Fuse(), Precision(), Checkpoint(budget=BUDGET)], BF16, True),
}
_REFERENCE: dict = {}


def model_and_reference():
    """The model (built once) and its eager loss and gradients on the example inputs."""
    if not _REFERENCE:
        zoo_model = real_models.build(NAME, seq=64)  # fewer tokens: no recomputation lowers the fused step's peak
        loss = step_loss(zoo_model, zoo_model.model)
        loss.backward()
        _REFERENCE.update(zoo_model=zoo_model, loss=loss.detach(),
                          grads={n: p.grad.clone() for n, p in zoo_model.model.named_parameters()})
    return _REFERENCE["zoo_model"], _REFERENCE["loss"], _REFERENCE["grads"]


def step_loss(zoo_model, model):
    inputs = dict(zoo_model.example_inputs)
    labels = inputs.pop("labels")
    return zoo_model.loss_fn(model(**inputs), labels)


def assert_trains_like_eager(passes, tolerance, normwise, backend="eager"):
    zoo_model, expected_loss, expected_grads = model_and_reference()
    model = zoo_model.model
    opt = picofx.optimize(model, zoo_model.example_inputs, passes, backend=backend, loss_fn=zoo_model.loss_fn)
    model.zero_grad(set_to_none=True)
    loss = real_models.loss_of(opt(**zoo_model.example_inputs))
    loss.backward()
    rtol, atol = tolerance
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=rtol / 2 if normwise else rtol, atol=atol)
    for name, param in model.named_parameters():
        expected = expected_grads[name]
        if normwise:
            error = torch.linalg.vector_norm(param.grad - expected) / torch.linalg.vector_norm(expected).clamp_min(atol)
            assert error <= rtol, f"gradient of {name} is off by {error:.3g} of its norm"
        else:
            torch.testing.assert_close(param.grad, expected, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    return opt


def assert_every_site_fused(graph, kinds=KINDS):
    after = census(graph)
    assert {kind: after[kind]["fused"] for kind in kinds} == {kind: FUSED[KINDS.index(kind)] for kind in kinds}, after
    assert all(after[kind]["unfused"] == 0 for kind in kinds), after
    rotations = [n for n in graph.nodes if n.target is picofx_ops.rope.default]
    assert len(rotations) == LAYERS and all(n.args[4] is True for n in rotations)  # interleaved pairs
    assert not any(n.target is aten.view_as_complex.default for n in graph.nodes)  # q and k stay real


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_each_pass_combination_trains_like_eager(combination):
    passes, tolerance, normwise = COMBINATIONS[combination]
    opt = assert_trains_like_eager(passes, tolerance, normwise)
    records = {r.name: r.notes for r in opt.report.records}
    if "fuse" in records:
        assert_every_site_fused(opt.graph_module.graph)
    if "checkpoint" in records:
        notes = records["checkpoint"]
        assert notes["recomputed"] > 0 and notes["peak_after"] <= notes["budget"] < notes["peak_before"]


def test_fuse_explains_nothing_left_and_a_second_run_changes_nothing():
    zoo_model, _, _ = model_and_reference()
    gm, ctx = captured(zoo_model)
    first = run_pass(Fuse(explain=True), gm, ctx)
    assert first.notes["unfused_sites"] == [] and first.notes["complex_rope"] == LAYERS
    second = run_pass(Fuse(explain=True), gm, ctx)
    assert not any(second.notes[rule] for rule in ("rms_norm", "swiglu", "complex_rope", "grouped_query_attention"))
    assert_every_site_fused(gm.graph)


def test_bf16_weights_fuse_every_block_with_the_casts_around_rope():
    """With bf16 weights q and k are upcast before the complex product and cast back after it.
    (The loss then follows an upcast of the logits: a loss form for the loss rule's own tests.)"""
    zoo_model = real_models.build(NAME)
    for child in zoo_model.model.children():  # not the root's complex table, which .to(bf16) would make real
        child.to(torch.bfloat16)
    gm, ctx = captured(zoo_model)
    assert count_ops(gm, aten._to_copy.default) > 0
    run_pass(Fuse(), gm, ctx)  # numerics against the unfused graph, at the low-precision tolerance
    assert_every_site_fused(gm.graph, kinds=("norm", "gated_mlp", "rope", "attention"))


@pytest.mark.slow
# The model's complex table (sliced, viewed) stays complex up to the rope op, which Inductor runs
# as ATen calls instead of generating code for: what it warns about.
@pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex operators")
def test_fused_step_with_inductor_trains_like_eager():
    # Inductor's generated reductions and fused pointwise code round differently from the ATen
    # kernels the eager run uses: fp32 ulps, more in gradients summed over many tokens.
    opt = assert_trains_like_eager([Fuse()], (1e-4, 1e-5), False, backend="inductor")
    assert_every_site_fused(opt.graph_module.graph)
