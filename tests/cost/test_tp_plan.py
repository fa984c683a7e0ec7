"""picofx.passes.tensor_parallel.plan: the Megatron plan read from the captured graph, not from module names."""
from __future__ import annotations

import pytest

from picofx.capture.export import capture_call
from picofx.passes.tensor_parallel.plan import infer_plan
from picofx.models import real_models, zoo


def plan_of(z, tp: int = 2):
    return infer_plan(capture_call(z.model, (), dict(z.example_inputs), z.loss_fn), tp)


def styles(plan, *suffixes) -> list[str]:
    return [plan.style(next(n for n in plan.parameters if n.endswith(s))) for s in suffixes]


def embedding_style(plan) -> str:
    """The style of the table the token lookup reads (a tied table is captured under one of its names)."""
    return next(p.style for p in plan.parameters.values() if p.why.startswith(("embedding table", "tied")))


def test_reference_llama_attention_and_mlp_pairs_embedding_and_head():
    plan = plan_of(zoo.build("llama-tiny"))
    layer = "decoder_layers.1."
    assert styles(plan, *(layer + p for p in ("attention.q_proj.weight", "attention.k_proj.weight",
                                              "attention.v_proj.weight", "mlp.gate_proj.weight",
                                              "mlp.up_proj.weight"))) == ["colwise"] * 5
    assert styles(plan, layer + "attention.out_proj.weight", layer + "mlp.down_proj.weight") == ["rowwise"] * 2
    assert plan.style("embedding.weight") == "vocab" and plan.style("final_proj.weight") == "colwise"
    assert "cross-entropy" in plan.parameters["final_proj.weight"].why
    assert {plan.style(n) for n in plan.parameters if "norm" in n} == {"replicate"}
    assert plan.kv_replicated == []


def test_key_value_heads_that_tp_does_not_divide_stay_whole_beside_split_queries():
    plan = plan_of(zoo.build("llama-tiny"), tp=4)  # 4 query heads, 2 key/value heads
    assert styles(plan, "1.attention.q_proj.weight", "1.attention.k_proj.weight", "1.attention.out_proj.weight") == \
        ["colwise", "replicate", "rowwise"]
    assert len(plan.kv_replicated) == 4 and "tp=4 does not divide" in plan.parameters[plan.kv_replicated[0]].why


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "gemma"])
def test_hugging_face_models_get_the_same_plan(architecture):
    plan = plan_of(real_models.hf_model(architecture))
    prefix = "model.layers.0."
    assert styles(plan, *(prefix + p for p in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                "self_attn.v_proj.weight", "mlp.gate_proj.weight",
                                                "mlp.up_proj.weight"))) == ["colwise"] * 5
    assert styles(plan, prefix + "self_attn.o_proj.weight", prefix + "mlp.down_proj.weight") == ["rowwise"] * 2
    assert embedding_style(plan) == "vocab"
    if architecture == "qwen2":  # q/k/v biases follow their weights' output features
        assert styles(plan, prefix + "self_attn.q_proj.bias", prefix + "self_attn.v_proj.bias") == ["colwise"] * 2


def test_tied_embedding_and_head_share_one_row_split():
    plan = plan_of(real_models.hf_model("llama", tie_word_embeddings=True))
    tied = [name for name, p in plan.parameters.items() if p.why.startswith("tied")]
    assert len(tied) == 1 and plan.style(tied[0]) == "vocab" and "LM head" in plan.parameters[tied[0]].why


def test_complex_rope_keeps_heads_apart():
    plan = plan_of(real_models.torchtitan_llama3())
    assert styles(plan, "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
                  "layers.0.attention.wo.weight") == ["colwise", "colwise", "rowwise"]


def test_gpt2_fused_qkv_is_left_whole_with_its_reason_and_positions_are_not_a_vocabulary():
    plan = plan_of(zoo.build("gpt2-tiny"))
    attention = plan.parameters["h.0.attn.c_attn.weight"]
    assert attention.style == "replicate" and "slices the split dimension" in attention.why
    assert plan.style("h.0.attn.c_proj.weight") == "replicate"
    assert (plan.style("h.0.c_fc.weight"), plan.style("h.0.c_fc.bias"), plan.style("h.0.c_proj.weight")) == \
        ("colwise", "colwise", "rowwise")
    assert plan.style("wpe.weight") == "replicate" and embedding_style(plan) == "vocab"
    assert "c_attn" in plan.table()
