"""Property: any LLaMA-style configuration, under any pass combination, optimizes and trains like
eager (loss and every gradient), or is refused with a picofx error that names the cause; never a
torch-internal traceback. Configurations come from hypothesis (picofx.models.llama_configs:
widths, heads, grouped-query ratio, layers, biases, tied embeddings, RoPE form, norm epsilon,
activation, vocabulary, batch and sequence; written as picofx's seed Llama, Hugging Face Llama
or Qwen2). A short profile runs with the suite; a longer one is marked slow."""
import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, example, given, note, settings
from hypothesis import strategies as st

import picofx
from picofx import errors
from picofx.models import llama_configs
from picofx.models.llama_configs import LlamaVariant
from picofx.manager.verify import FP32_TOLERANCE
from picofx.passes.checkpoint.checkpoint import Checkpoint
from picofx.passes.fuse.fuse import Fuse
from picofx.passes.precision.precision import TOLERANCE, Precision
from picofx.testing import assert_trains_like_eager

FUSED = (1e-5, 1e-5)  # what the fuse rules declare: sums in another order
# precision rounds every matmul input to bf16: ~1% of each gradient's norm (picofx.passes.precision.precision),
# compared tensor by tensor (norm-wise)
BF16 = TOLERANCE[torch.bfloat16]
COMBINATIONS = ("none", "fuse", "precision", "checkpoint", "fuse+precision", "all")

# Each example captures and compiles a model (seconds): no shrinking, the failing example is printed
# whole (note) with the blob that reproduces it.
UNSHRUNK = dict(deadline=None, print_blob=True, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("short", max_examples=12, derandomize=True, **UNSHRUNK)
settings.register_profile("long", max_examples=60, **UNSHRUNK)


@st.composite
def variants(draw) -> LlamaVariant:
    codebase = draw(st.sampled_from(llama_configs.CODEBASES))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    kv_heads = draw(st.integers(1, 4))
    group = draw(st.sampled_from([1, 2, 4]))  # query heads per key/value head (1: multi-head)
    assume(kv_heads * group * head_dim <= 64)  # hidden size
    return LlamaVariant(
        head_dim=head_dim, kv_heads=kv_heads, group=group, layers=draw(st.integers(1, 2)),
        intermediate_size=draw(st.integers(4, 96)), vocab_size=draw(st.integers(8, 128)),
        bias=draw(st.booleans()), tied=draw(st.booleans()),
        rope=draw(st.sampled_from(llama_configs.ROPE_FORMS)) if codebase == "picofx" else "rotate_half",
        norm_eps=draw(st.sampled_from([1e-6, 1e-5]) | st.floats(1e-8, 1e-2)),
        activation=draw(st.sampled_from(sorted(llama_configs.ACTIVATIONS))), codebase=codebase)


def passes_for(combination: str, budget: float) -> tuple[list, tuple[float, float], bool]:
    """The passes, the tolerance they are held to and whether it is norm-wise."""
    checkpoint = [Checkpoint(budget=budget)] if combination in ("checkpoint", "all") else []
    fuse = [Fuse()] if combination in ("fuse", "fuse+precision", "all") else []
    precision = [Precision()] if combination in ("precision", "fuse+precision", "all") else []
    if precision:
        return [*fuse, *precision, *checkpoint], BF16, True
    return [*fuse, *checkpoint], FUSED if fuse else FP32_TOLERANCE, False


def assert_refusal_names_its_cause(error: Exception) -> None:
    """A valid model may be refused only for a reason picofx states: a budget no plan meets, or an
    error raised on purpose. A pass that crashed (its cause a torch or Python error) or broke its
    graph (caught by the verifier) is a bug in that pass, whatever wraps it."""
    assert isinstance(error, (errors.CaptureError, errors.PassError, errors.BudgetError, errors.InputShapeError)), \
        f"{type(error).__name__} is not a picofx error: {error}"
    assert str(error).strip(), f"{type(error).__name__} without a message"
    if isinstance(error, errors.PassError) and not isinstance(error, errors.BudgetError):
        raise AssertionError(f"a pass failed on a valid model: {error}") from error


def check(variant: LlamaVariant, batch: int, seq: int, combination: str, budget: float) -> None:
    passes, tolerance, normwise = passes_for(combination, budget)
    note(f"{variant}, batch {batch}, seq {seq}, passes {combination} (budget {budget:.3f})")
    zoo_model = llama_configs.build(variant, batch=batch, seq=seq)
    try:
        assert_trains_like_eager(zoo_model, passes, batches=[zoo_model.example_inputs], tolerance=tolerance,
                                 normwise=normwise)
    except AssertionError:
        raise
    except Exception as error:  # noqa: BLE001  the property: any other error is a stated refusal
        note(f"refused: {type(error).__name__}: {error}")
        assert_refusal_names_its_cause(error)


@st.composite
def examples(draw) -> tuple:
    variant = draw(variants())
    # Hugging Face shifts the labels inside the model: one token leaves no target (a nan loss)
    seq = draw(st.integers(1 if variant.codebase == "picofx" else 2, 16))
    return (variant, draw(st.integers(1, 3)), seq, draw(st.sampled_from(COMBINATIONS)), draw(st.floats(0.9, 1.0)))


@settings(settings.get_profile("short"))
@given(examples())
def test_any_configuration_trains_like_eager_or_is_refused_clearly(case):
    check(*case)


# Failures the long profile found, kept as explicit examples: grouped-query k/v expanded to stride 0
# crashed checkpoint's scratch measurement; a k bias gradient that nearly cancels moved 3.9% in bf16.
FOUND = [
    (LlamaVariant(head_dim=8, kv_heads=1, group=4, layers=1, intermediate_size=47, vocab_size=65, tied=True,
                  norm_eps=0.0010537092943960036, codebase="hf-llama"), 1, 13, "checkpoint", 0.977),
    (LlamaVariant(head_dim=16, kv_heads=4, group=1, layers=1, intermediate_size=65, vocab_size=53, bias=True,
                  tied=True, norm_eps=1.192092896e-07, activation="gelu", codebase="hf-llama"), 2, 3, "precision", 0.9),
]


@pytest.mark.slow
@settings(settings.get_profile("long"))
@example(FOUND[0])
@example(FOUND[1])
@given(examples())
def test_any_configuration_trains_like_eager_or_is_refused_clearly_long(case):
    check(*case)
