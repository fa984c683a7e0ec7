"""The planner prices Shard's float8 gathers as picofx/passes/shard/float8_gather.py runs them: the shard
casts of each gather (the forward's with its amax, the backward's re-gather keeping the scales), one
all-reduce of the scales per forward, float8 gathers at stage 3 only, and a head tied to the embedding
counted once."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from picofx.cost import float8 as float8_cost
from picofx.cost.comm import all_reduce_seconds
from picofx.cost.device import devices
from picofx.cost.shard import Layer
from picofx.planner.costs import ModelCosts
from picofx.planner.float8 import at_precision, gather_bytes_per_parameter, layer_linears, with_float8
from picofx.planner.layouts import Layout, Run, predict
from picofx.planner import models
from picofx.planner.models import model_config, parameter_count
from picofx.planner.sharding import sharded_step

H100 = devices()["h100"]


def llama3_8b(seq: int = 8192, gpus: int = 8, batch: int = 16) -> Run:
    """Llama 3 8B's costs made up from its linears' bf16 time, without a capture."""
    config = model_config("llama3-8b")
    linears = [float8_cost.linear_times(H100, seq, lin.inputs, lin.outputs, "tensorwise")
               for lin in layer_linears(config)]
    forward = 2 * sum(t.bf16_forward for t in linears)
    costs = ModelCosts(config, seq, forward, 2 * forward, 5 * 10**8, 0.2 * forward, 0.4 * forward, 10**9, 10**9,
                       parameter_count(config), 6 * 8e9, layer_matmul_forward_s=forward / 2)
    return Run(costs, H100, gpus, 8, batch)


def sharded(stage: int, precision: str = "float8", gpus: int = 8, microbatches: int = 1) -> Layout:
    return Layout(gpus, 1, 1, shard=True, microbatches=microbatches, checkpoint="selective", precision=precision,
                  shard_stage=stage)


def test_each_gather_casts_the_shard_as_the_compiled_code_reads_it():
    """Inductor's CPU kernels for the float8 gather (read from the generated code): the amax reads the fp32
    shard (4 bytes), the cast reads it again and writes a byte (5: the scales' all-reduce sits between
    them, so they cannot fuse), the bucket's concatenation copies the bytes (2). The backward's re-gather
    keeps the scales: 5 + 2. Only the backward's transposed copy (2 bytes) is made of the whole weight."""
    k, n, ranks, bandwidth = 4096, 14336, 8, H100.pointwise_bandwidth()
    again = float8_cost.linear_times(H100, 8192, k, n, "tensorwise", gathered_over=ranks)
    assert again.weight_forward == pytest.approx(k * n * (4 + 5 + 2) / ranks / bandwidth)
    assert again.weight_backward == pytest.approx(k * n * (2 + (5 + 2) / ranks) / bandwidth)
    kept = float8_cost.linear_times(H100, 8192, k, n, "tensorwise", gathered_over=ranks, regathered=False)
    assert kept.weight_forward == again.weight_forward
    assert kept.weight_backward == pytest.approx(k * n * 2 / bandwidth)


def test_the_second_gather_is_priced_where_the_layout_reshards_after_the_forward():
    run = llama3_8b()
    resharded, _ = with_float8(run.costs, H100, precision="float8", gathered_over=8)
    kept, _ = with_float8(run.costs, H100, precision="float8", gathered_over=8, regathered=False)
    assert resharded.layer_call_forward_s == kept.layer_call_forward_s
    float8_weights = resharded.layer_float8_parameters
    assert resharded.layer_call_backward_s - kept.layer_call_backward_s == pytest.approx(
        float8_weights * 7 / 8 / H100.pointwise_bandwidth())
    # the planned layout (stage 3, Shard's default) reshards: the backward casts the shards again
    planned, _ = at_precision(run.costs, H100, sharded(3), 8192)
    assert planned.layer_call_backward_s == pytest.approx(resharded.layer_call_backward_s)


def test_one_all_reduce_of_the_scales_per_forward_on_the_shard_group():
    run = llama3_8b()
    link = run.link(8)
    layers = [Layer(f"l{i}", 2 * 10**8, 1e-3, 2e-3, 1.0) for i in range(4)]
    plain = sharded_step(3, layers, 8, link, 2)
    scaled = sharded_step(3, layers, 8, link, 2, float8_weights=28)
    scales = all_reduce_seconds(4 * 28, 8, link)  # one fp32 amax per weight, latency-bound
    assert scaled.exposed_s - plain.exposed_s == pytest.approx(2 * scales)  # once a micro-batch, nothing hides it
    assert scaled.communication_s - plain.communication_s == pytest.approx(2 * scales)
    # a decoder layer's seven linears gather in float8 at stage 3 under tensorwise only
    counts = {(stage, precision): at_precision(run.costs, H100, sharded(stage, precision), 8192)[0].layer_float8_weights
              for stage in (2, 3) for precision in ("float8", "float8_rowwise")}
    assert counts == {(3, "float8"): 7, (3, "float8_rowwise"): 0, (2, "float8"): 0, (2, "float8_rowwise"): 0}


def test_stages_1_and_2_gather_high_precision_and_cast_the_whole_weights():
    """Shard at stages 1 and 2 leaves the graph reading whole parameters: nothing is gathered in float8,
    each float8 linear casts its whole weight per call, as unsharded."""
    run = llama3_8b()
    unsharded, _ = with_float8(run.costs, H100, precision="float8")
    for stage in (1, 2):
        costs, _ = at_precision(run.costs, H100, sharded(stage), 8192)
        assert costs.layer_call_forward_s == unsharded.layer_call_forward_s
        assert gather_bytes_per_parameter(costs) == 2.0
    link = run.link(8)
    whole = [Layer(f"l{i}", 2 * 10**8, 1e-3, 2e-3) for i in range(4)]
    in_float8 = [dataclasses.replace(layer, gather_bytes_per_parameter=1.5) for layer in whole]
    for stage in (1, 2):
        assert sharded_step(stage, in_float8, 8, link, 2).communication_s == \
            sharded_step(stage, whole, 8, link, 2).communication_s
    bf16, float8 = (predict(run, sharded(2, p)) for p in ("bf16", "float8"))
    assert float8.memory["gathered"] == bf16.memory["gathered"]  # the whole parameters kept as bf16's


def test_a_tied_head_is_counted_once_and_named_in_the_float8_choices(tmp_path):
    """A Hugging Face config with tie_word_embeddings (Qwen2's, Llama 3.2's small models): the planner
    counts the parameters as the model holds them (one vocabulary x hidden matrix); the head stays bf16
    and the choices say Shard would gather it in its own dtype."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(hf.to_dict()))
    config = model_config(str(tmp_path))
    assert models.tied(config) and not models.tied(model_config("llama3-8b"))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf)
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())  # the tied matrix once
    from picofx.planner.api import as_config
    qwen2 = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    assert models.tied(as_config(qwen2)) and as_config(qwen2).vocab_size == 512  # picofx.plan(a Qwen2 model)
    costs = ModelCosts(config, 64, 1e-4, 2e-4, 10**6, 1e-4, 2e-4, 10**6, 10**6, parameter_count(config), 1e6)
    assert costs.embedding_parameters == 512 * 64 + 64 and costs.layer_parameters == \
        (parameter_count(config) - costs.embedding_parameters) // 2
    _, chosen = with_float8(costs, H100, precision="float8")
    assert chosen["head"].startswith("bf16") and "tied to the embedding" in chosen["head"]
    assert "tied" not in with_float8(llama3_8b().costs, H100, precision="float8")[1]["head"]


@pytest.mark.slow  # two Inductor compiles: ~45 s on a shared 2-core CPU
def test_inductor_reads_the_shard_apart_for_the_amax_and_the_cast(tmp_path, monkeypatch):
    """What SHARD_GATHER_BYTES and SHARD_REGATHER_BYTES count, as Inductor compiles the float8 gather's shard
    side on CPU (one rank): the amax in one kernel, the cast in another (the all-reduce between them), the
    bucket's bytes concatenated by a copy; the re-gather casts with the kept scales and copies, no amax."""
    import random

    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    from picofx.passes.shard.float8_gather import float8_bytes, local_amaxes, scales_of

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(random.randint(30000, 60000)))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        group, c10d = dist.group.WORLD.group_name, torch.ops._c10d_functional

        def gather(a, b, scales):
            flat = torch.cat([float8_bytes(a, scales[0]), float8_bytes(b, scales[1])])
            return c10d.wait_tensor(c10d.all_gather_into_tensor(flat, 1, group))

        def forward(a, b):
            scales = scales_of(c10d.wait_tensor(c10d.all_reduce(local_amaxes(a, b), "max", group)))
            return gather(a, b, scales), scales

        a, b = torch.randn(64, 32), torch.randn(32, 32)
        (_, scales), (first,) = run_and_get_code(torch.compile(forward, backend="inductor"), a, b)
        _, (again,) = run_and_get_code(torch.compile(gather, backend="inductor"), a, b, scales)
    finally:
        dist.destroy_process_group()

    def kernels(code: str) -> list[str]:
        return [line.split(" = ")[0] for line in code.splitlines() if line.startswith("cpp_fused")]

    assert [("amax" in k, "_to_copy" in k) for k in kernels(first)] == [(True, False), (False, True)]
    assert [("amax" in k, "_to_copy" in k) for k in kernels(again)] == [(False, True)]
    assert all(code.count("aten.cat.default(") == 1 for code in (first, again))  # the bucket's copy
