"""picofx.cost.float8: one float8 linear cost model, against torchao's published H100 microbenchmark,
read by both the precision pass's "auto" rule and the planner."""
from __future__ import annotations

import pytest

from picofx.cost import float8 as float8_cost
from picofx.cost.device import H100, cpu

# torchao's float8 README ("Performance"), fwd + bwd of one linear on an H100 against bf16, both compiled:
# (recipe, M, K, N, speedup). Only the large point was used to fit TENSORWISE_GEMM_SHARE.
PUBLISHED = [("tensorwise", 1024, 2048, 1024, 0.80), ("tensorwise", 4096, 8192, 16384, 1.39)]
TOLERANCE = 0.06  # relative: the model prices no tile or wave effects, so a 6% miss is allowed


@pytest.mark.parametrize("recipe, m, k, n, measured", PUBLISHED)
def test_the_model_reproduces_each_published_point_in_sign_and_ratio(recipe, m, k, n, measured):
    predicted = float8_cost.speedup(H100, m, k, n, recipe)
    assert (predicted > 1) == (measured > 1), (predicted, measured)
    assert predicted == pytest.approx(measured, rel=TOLERANCE)


def test_rowwise_recipes_pay_less_than_tensorwise_and_all_turn_with_the_shape():
    small, large = (1024, 2048, 1024), (8192, 8192, 28672)
    for recipe in float8_cost.RECIPE_COSTS:
        assert float8_cost.speedup(H100, *small, recipe) < 1 < float8_cost.speedup(H100, *large, recipe), recipe
    tensorwise, rowwise, gw_hp = (float8_cost.speedup(H100, *large, r) for r in float8_cost.RECIPE_COSTS)
    assert rowwise < tensorwise and gw_hp < tensorwise


def test_the_weight_gradient_in_high_precision_costs_a_bf16_gemm():
    m = k = n = 4096
    times = float8_cost.linear_times(H100, m, k, n, "rowwise_with_gw_hp")
    float8_gemm = 2 * m * k * n / (H100.matmul_rate(float8_cost.FLOAT8, 4096)
                                   * float8_cost.RECIPE_COSTS["rowwise_with_gw_hp"].gemm_share)
    gradient_cast = m * n * 4 / H100.pointwise_bandwidth()  # along one axis; x is not cast again
    assert times.float8_backward == pytest.approx(float8_gemm + times.bf16_forward + gradient_cast)


def test_an_unfused_amax_and_a_float8_gather_are_priced():
    fused = float8_cost.linear_times(H100, 8192, 4096, 4096, "tensorwise")
    unfused = float8_cost.linear_times(H100, 8192, 4096, 4096, "tensorwise", amax_fused=False)
    assert unfused.float8_forward - fused.float8_forward == pytest.approx(
        8192 * 4096 * float8_cost.UNFUSED_AMAX_BYTES / H100.pointwise_bandwidth())
    gathered = float8_cost.linear_times(H100, 8192, 4096, 4096, "tensorwise", gathered_over=8)
    assert gathered.weight_forward < fused.weight_forward


def test_an_unknown_recipe_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="recipe 'blockwise' is unknown; use one of tensorwise, rowwise"):
        float8_cost.linear_times(cpu(1), 16, 16, 16, "blockwise")
