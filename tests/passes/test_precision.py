"""Pass `precision` on graphs: the dtype every node computes in, per rule and override; casts; errors."""
import pytest
import torch
from precision_models import (BF16, FP32, Cancellation, EqualDtypes, FusedToy, RuleToy, autocast_graph, calls,
                              dtype, float_casts, float_inputs, graph_copy, linears_by_module)

from picofx import PassError
from picofx.models import zoo
from picofx.models.zoo import ZooModel
from picofx.passes import Precision
from picofx.passes.precision.rules import op_name
from picofx.testing import captured, run_pass

NORM_STATISTICS = {"aten.pow", "aten.mean", "aten.rsqrt"}


@pytest.fixture(scope="module")
def llama_graph():
    return captured(zoo.build("llama-tiny"))


@pytest.fixture(scope="module", params=["llama-tiny", "hf-llama-tiny"])
def precise(request, llama_graph):
    """A zoo model's graph after Precision() and the pass's record."""
    gm, ctx = llama_graph if request.param == "llama-tiny" else captured(zoo.build(request.param))
    gm = graph_copy(gm)
    # The manager's numerics check is elementwise with an absolute atol; HF's gradients span four
    # orders of magnitude, so its numerics are checked norm-wise in test_gradients_close_to_fp32.
    record = run_pass(Precision(), gm, ctx, verify="numerics" if request.param == "llama-tiny" else "invariants")
    return request.param, gm, record


def test_every_matmul_and_attention_computes_in_bf16(precise):
    _, gm, record = precise
    nodes = calls(gm, "matmul", "attention")
    assert len(nodes) == 15 + 2 and record.notes["rules"]["matmul"] == 15 and record.notes["rules"]["attention"] == 2
    for node in nodes:
        assert dtype(node) == BF16 and {dtype(a) for a in float_inputs(node)} == {BF16}, node.format_node()


def test_norm_statistics_and_loss_compute_in_fp32(precise):
    _, gm, _ = precise
    statistics = [n for n in gm.graph.nodes if op_name(n.target) in NORM_STATISTICS and "norm" in n.meta["module_path"]]
    assert len(statistics) == 5 * 3  # pow, mean, rsqrt in each of the 5 RMSNorms
    assert {dtype(n) for n in statistics} == {FP32}
    log_softmax = next(n for n in gm.graph.nodes if op_name(n.target) == "aten._log_softmax")
    assert {dtype(a) for a in float_inputs(log_softmax)} == {FP32}
    loss_nodes, frontier = set(), [log_softmax]
    while frontier:  # everything computed from the log-probabilities
        node = frontier.pop()
        if node.op != "output" and node not in loss_nodes:
            loss_nodes.add(node)
            frontier.extend(node.users)
    assert {dtype(n) for n in loss_nodes if n.meta["val"].is_floating_point()} == {FP32}


def test_graph_outputs_keep_their_captured_dtypes(precise):
    name, gm, record = precise
    outputs = gm.graph.output_node().all_input_nodes
    assert {dtype(n) for n in outputs} == {FP32}
    assert record.notes["output_casts"] == (1 if name == "hf-llama-tiny" else 0)  # HF returns the logits


def test_casts_are_shared_and_fewer_than_autocasts(precise):
    name, gm, record = precise
    casts = float_casts(gm)
    assert len(casts) == len(set(casts)), "a value is cast to the same dtype twice"
    weights = [src for src, _ in casts if src.op == "placeholder"]
    assert len(weights) == record.notes["weight_casts"] == 15  # each matmul weight once
    assert len(casts) < len(float_casts(autocast_graph(zoo.build(name))))


def test_running_twice_changes_nothing(llama_graph):
    gm, ctx = llama_graph
    gm = graph_copy(gm)
    run_pass(Precision(), gm, ctx)
    again = run_pass(Precision(), gm, ctx)
    assert not again.changed and again.nodes_before == again.nodes_after and not again.added


# ---- one test per rule, on small modules that exercise it ------------------------------------

@pytest.fixture(scope="module")
def rule_toy():
    torch.manual_seed(0)
    z = ZooModel(RuleToy(), {"x": torch.randn(2, 8, 16), "mask": torch.randn(8, 8),
                             "labels": torch.randint(0, 10, (2, 8))}, None)
    gm, ctx = captured(z)
    record = run_pass(Precision(fp32_ops=("aten.sigmoid",)), gm, ctx)
    return {op_name(n.target): n for n in gm.graph.nodes if n.op == "call_function"}, record


def test_rule_matmul(rule_toy):
    nodes, _ = rule_toy
    linear = nodes["aten.linear"]  # the head (the last linear)
    assert dtype(linear) == BF16 and [dtype(a) for a in linear.args] == [BF16] * 3  # x, weight, bias


def test_rule_attention_casts_float_mask_too(rule_toy):
    nodes, _ = rule_toy
    sdpa = nodes["aten.scaled_dot_product_attention"]
    assert dtype(sdpa) == BF16 and {dtype(a) for a in float_inputs(sdpa)} == {BF16}


def test_rule_norm_statistics(rule_toy):
    nodes, _ = rule_toy
    norm = nodes["aten.native_layer_norm"]
    assert [dtype(a) for a in float_inputs(norm)] == [FP32] * 3 and dtype(norm.args[0].args[0]) == BF16


def test_rule_softmax_and_loss(rule_toy):
    nodes, _ = rule_toy
    assert dtype(nodes["aten._log_softmax"]) == FP32 and dtype(nodes["aten._log_softmax"].args[0].args[0]) == BF16
    assert dtype(nodes["aten.div"]) == FP32  # the mean over tokens


def test_rule_rope_tables_stay_fp32(rule_toy):
    nodes, record = rule_toy
    assert {dtype(nodes[op]) for op in ("aten.mm", "aten.cos", "aten.sin")} == {FP32}
    assert record.notes["rules"]["rope_tables"] == 3  # the weight-free mm, cos, sin


def test_rule_user_fp32_ops(rule_toy):
    nodes, record = rule_toy
    assert dtype(nodes["aten.sigmoid"]) == FP32 and record.notes["rules"]["fp32_ops"] == 1


def test_rule_fused_ops_run_in_compute_dtype_with_fp32_loss():
    import picofx.kernels  # noqa: F401  (registers the fused ops)

    torch.manual_seed(0)
    z = ZooModel(FusedToy(), {"x": torch.randn(2, 8, 16), "cos": torch.randn(8, 16), "sin": torch.randn(8, 16),
                              "labels": torch.randint(0, 10, (2, 8))}, None)
    gm, ctx = captured(z)
    record = run_pass(Precision(), gm, ctx)
    nodes = {op_name(n.target): n for n in gm.graph.nodes if n.op == "call_function"}
    silu_mul = nodes["picofx.silu_mul"]
    assert {dtype(a) for a in float_inputs(silu_mul)} == {BF16} and dtype(silu_mul) == BF16
    # The norms read the fp32 stream and weight as they come and write bf16: one rounding, after.
    total, normed = nodes["picofx.add_rms_norm"].meta["val"]
    assert {dtype(a) for a in float_inputs(nodes["picofx.add_rms_norm"])} == {FP32}
    assert (total.dtype, normed.dtype) == (FP32, BF16)
    norm = nodes["picofx.rms_norm"]
    assert [dtype(a) for a in float_inputs(norm)] == [BF16, FP32] and dtype(norm) == BF16
    assert record.notes["rules"]["fused_norms"] == 2 and record.notes["rounded_outputs"] == 2
    assert {t.dtype for t in nodes["picofx.rope"].meta["val"]} == {FP32}  # follows its fp32 tables
    loss = nodes["picofx.linear_cross_entropy"]
    assert [dtype(a) for a in loss.args[:2]] == [BF16, BF16] and loss.args[6] is True
    assert loss.meta["val"][0].dtype == FP32
    assert record.notes["rules"]["fused"] == 2 and record.notes["loss_upcast"] == 1


def test_ops_that_need_equal_dtypes_compute_in_their_inputs_promotion():
    torch.manual_seed(0)
    gm, ctx = captured(ZooModel(EqualDtypes(), {"x": torch.randn(4, 8)}, None))
    run_pass(Precision(), gm, ctx)
    index_put = next(n for n in gm.graph.nodes if op_name(n.target) == "aten.index_put")
    assert dtype(index_put) == FP32 and {dtype(a) for a in float_inputs(index_put)} == {FP32}
    assert dtype(index_put.args[0].args[0]) == BF16  # the bf16 matmul output, cast up


# ---- overrides -----------------------------------------------------------------------------

def test_overrides_by_module_glob(llama_graph):
    gm, ctx = llama_graph
    gm = graph_copy(gm)
    record = run_pass(Precision(overrides={"final_proj": "fp32", "decoder_layers.0.*": "fp32"}), gm, ctx)
    dtypes = linears_by_module(gm)
    assert dtypes.pop("final_proj") == FP32
    assert {d for path, d in dtypes.items() if path.startswith("decoder_layers.0.")} == {FP32}
    assert {d for path, d in dtypes.items() if path.startswith("decoder_layers.1.")} == {BF16}
    sdpa = [dtype(n) for n in calls(gm, "attention")]
    assert sdpa == [FP32, BF16]
    assert record.notes["overrides"] == {"final_proj": 1, "decoder_layers.0.*": 7 + 1}
    assert record.notes["weight_casts"] == 7  # only layer 1's weights are cast


def test_later_override_wins(llama_graph):
    gm, ctx = llama_graph
    gm = graph_copy(gm)
    run_pass(Precision(overrides={"decoder_layers.*": "fp32", "decoder_layers.1.mlp": "bf16"}), gm, ctx)
    dtypes = linears_by_module(gm)
    layer_1_mlp = {f"decoder_layers.1.mlp.{name}_proj" for name in ("gate", "up", "down")}
    assert {path for path, d in dtypes.items() if d == BF16} == layer_1_mlp | {"final_proj"}


def test_sensitivity_keeps_nodes_above_the_threshold_in_fp32():
    torch.manual_seed(0)
    z = ZooModel(Cancellation(), {"x": torch.randn(4, 32), "target": torch.randn(4, 32)}, None)
    gm, ctx = captured(z)
    record = run_pass(Precision(sensitivity=0.05), gm, ctx)
    dtypes = linears_by_module(gm)
    assert dtypes == {"coarse": FP32, "fine": BF16}
    errors = {next(n for n in gm.graph.nodes if n.name == name).meta["module_path"]: error
              for name, error in record.notes["sensitivity_errors"].items()}
    assert errors["coarse"] > 0.05 > 0.01 > errors["fine"]  # bf16's relative error is ~2**-9 per product
    assert record.notes["kept_fp32"].startswith("linear") and "(coarse)" in record.notes["kept_fp32"]
    assert record.notes["low_precision_nodes"] == 1


# ---- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("options, error, words", [
    ({"dtype": "int8"}, ValueError, "unknown dtype 'int8'"),
    ({"overrides": {"final_proj": "fp8"}}, ValueError, "unknown dtype for override 'final_proj'"),
    ({"dtype": "fp16"}, ValueError, "fp16 without a way to scale the loss"),
    ({"overrides": {"final_proj": "fp16"}}, ValueError, "fp16 without a way to scale the loss"),
    ({"dtype": "fp16", "loss_scale": torch.amp.GradScaler("cpu", enabled=False)}, ValueError, "fp16 without"),
    ({"loss_scale": torch.amp.GradScaler("cpu")}, ValueError, "needs no loss scaling"),
    ({"dtype": "fp16", "loss_scale": 1024.0}, TypeError, "must be a torch.amp.GradScaler"),
    ({"fp32_ops": ("aten.not_an_op",)}, ValueError, "not a registered op"),
    ({"sensitivity": 0}, ValueError, "threshold > 0"),
])
def test_bad_policy_is_a_clear_error(options, error, words):
    with pytest.raises(error, match=words):
        Precision(**options)


def test_override_matching_no_module_is_a_clear_error(llama_graph):
    gm, ctx = llama_graph
    gm = graph_copy(gm)
    before = len(gm.graph.nodes)
    with pytest.raises(PassError, match=r"override 'decoder_layer\.\*' matches no module .* decoder_layers\.0"):
        run_pass(Precision(overrides={"decoder_layer.*": "fp32"}), gm, ctx)
    assert len(gm.graph.nodes) == before
