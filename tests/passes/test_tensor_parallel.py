"""tensor_parallel: two gloo ranks (spawned, hard timeout), each with the same full batch, against
the single-process run: loss rtol 1e-5, gathered gradients rtol 1e-4 (DESIGN §9)."""
from __future__ import annotations

import re

import pytest
import torch

import picofx
from picofx.models import real_models, zoo
from picofx.passes import TensorParallel

import tensor_parallel_ranks
from spawn_ranks import run_ranks, run_scenarios

LOSS = dict(rtol=1e-5, atol=1e-7)
GRAD = dict(rtol=1e-4, atol=1e-6)


def assert_gradients_equal(actual: dict, expected: dict, names=None) -> None:
    """Each gradient of `names` (default: every expected one) equal within GRAD, named when not."""
    for name in names or expected:
        torch.testing.assert_close(actual[name], expected[name], **GRAD, msg=lambda m, n=name: f"{n}: {m}")


def assert_trained_and_saved_as(ranks: list, model, directory: str) -> None:
    """Every rank's parameters, and the DCP checkpoint the ranks saved loaded into a plain model,
    equal `model`'s (trained in one process) within AdamW's atol."""
    import torch.distributed.checkpoint as dcp

    expected = {n: p.detach() for n, p in model.named_parameters()}
    for rank in ranks:
        for name, value in expected.items():
            torch.testing.assert_close(rank["parameters"][name], value, rtol=0, atol=1e-5, msg=name)
    plain = zoo.build("llama-tiny", seed=1).model
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    plain.load_state_dict(state, strict=True)
    for name, value in expected.items():
        torch.testing.assert_close(plain.get_parameter(name), value, rtol=0, atol=1e-5, msg=name)


def single(z: zoo.ZooModel) -> tuple[torch.Tensor, dict]:
    batch = dict(z.example_inputs)
    out = z.model(**batch) if z.loss_fn is None else z.loss_fn(z.model(batch["input_ids"]), batch["labels"])
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in z.model.named_parameters()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank scenarios in one spawned group (a group each cost a start, imports and fuse's patterns)."""
    module = tensor_parallel_ranks
    calls = [(module.llama,), (module.adamw_and_checkpoint, str(tmp_path_factory.mktemp("tp") / "checkpoint")),
             (module.with_fuse, "eager"), (module.awkward_shapes,)]
    return {**run_scenarios(calls, 2, timeout=1500, collective_timeout=600), "directory": calls[1][1]}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """The 4-rank scenarios in one spawned group."""
    module = tensor_parallel_ranks
    calls = [(module.with_data_parallel,), (module.with_shard, str(tmp_path_factory.mktemp("tp") / "checkpoint")),
             (module.with_pipeline,), (module.uneven,)]
    return {**run_scenarios(calls, 4, timeout=2400, collective_timeout=300), "directory": calls[1][1]}


@pytest.fixture(scope="module")
def llama_ranks(two_ranks):
    return two_ranks["llama"]


@pytest.mark.parametrize("case, build", [("reference", lambda: zoo.build("llama-tiny")),
                                         ("hf", lambda: real_models.hf_model("llama")),
                                         ("qwen2", lambda: real_models.hf_model("qwen2")),
                                         ("tied", lambda: real_models.hf_model("llama", tie_word_embeddings=True)),
                                         ("sequence", lambda: zoo.build("llama-tiny")),
                                         ("hf sequence", lambda: real_models.hf_model("llama"))])
def test_loss_and_gathered_gradients_equal_the_single_process_run(llama_ranks, case, build):
    torch.manual_seed(0)
    loss, grads = single(build())
    for rank in llama_ranks:
        result = rank[case]
        torch.testing.assert_close(result["loss"], loss, **LOSS)
        assert result["grads"].keys() == grads.keys()
        assert_gradients_equal(result["grads"], grads)


def test_parameters_are_dtensors_placed_as_megatron_under_their_own_names(llama_ranks):
    result = llama_ranks[0]["reference"]
    placements, shapes = result["placements"], result["local_shapes"]
    assert placements["decoder_layers.0.attention.q_proj.weight"] == "S(0)"
    assert placements["decoder_layers.0.attention.out_proj.weight"] == "S(1)"
    assert placements["decoder_layers.0.mlp.down_proj.weight"] == "S(1)"
    assert placements["embedding.weight"] == "S(0)"
    assert placements["decoder_layers.0.input_layernorm.weight"] == "R"
    assert shapes["decoder_layers.0.attention.q_proj.weight"] == (32, 64)  # 64 output features over 2 ranks
    assert shapes["decoder_layers.0.mlp.down_proj.weight"] == (64, 88)
    notes = result["notes"]
    assert notes["colwise"] == 11 and notes["rowwise"] == 4 and notes["vocab"] == 1
    assert placements["final_proj.weight"] == "S(0)" and shapes["final_proj.weight"] == (128, 64)  # 256 rows
    line = next(x for x in result["plan"].splitlines() if x.startswith("decoder_layers.0.attention.q_proj.weight"))
    assert "colwise" in line and "read by decoder_layers.0.attention.out_proj.weight" in line
    assert result["widest"] == 256 // 2  # the local logits; no tensor holds the 256 of a token


def test_sequence_parallel_runs_the_residual_stream_on_sequence_shards(llama_ranks):
    notes = llama_ranks[0]["sequence"]["notes"]
    assert float(notes["sequence_parallel_saves"].split()[0]) > 0
    assert llama_ranks[0]["sequence"]["widest"] == 256 // 2


@pytest.mark.parametrize("case", ["sequence", "hf sequence"])
def test_sequence_parallel_gathers_again_in_the_backward_instead_of_saving_gathered_rows(llama_ranks, case):
    result = llama_ranks[0][case]
    assert result["saved_gathers"] == 0  # in the decoder layers
    assert result["regathered"] == 4  # 2 layers x (attention, MLP)
    assert result["gathers"]["backward"] >= 4


@pytest.mark.parametrize("case, overlapped", [("reference", 5), ("tied", 5), ("sequence", 5), ("hf sequence", 5)])
def test_the_graphs_that_run_hold_functional_collectives_some_waited_after_matmuls(llama_ranks, case, overlapped):
    """No picofx operator is left in the forward and backward graphs: each collective is torch's
    functional one, its wait just before the first node that reads it; in the backward, each
    column-parallel block's input-gradient all-reduce (or reduce-scatter) has the block's
    weight-gradient matmuls under it: 2 layers x (attention, MLP) and the LM head."""
    graphs = llama_ranks[0][case]["collectives"]
    for role, found in graphs.items():
        assert found["picofx"] == [], role
        assert found["issues"] > 0 and found["unwaited"] == 0 and found["early waits"] == 0, (role, found)
    assert graphs["backward"]["under a matmul"] >= overlapped


def issued_then_a_matmul_then_waited(code: str) -> int:
    """How many of the collectives in Inductor's generated `code` have an extern matmul between
    their issue and the wait for their buffer."""
    lines, count = code.splitlines(), 0
    for i, line in enumerate(lines):
        issued = re.search(r"_c10d_functional\.\w+\.default\((?:reinterpret_tensor\()?(buf\d+)\b", line)
        if issued and "wait_tensor" not in line:
            waited = re.compile(rf"wait_tensor\.default\((?:reinterpret_tensor\()?{issued.group(1)}\b")
            wait = next((j for j in range(i + 1, len(lines)) if waited.search(lines[j])), i)
            count += any("extern_kernels.mm(" in x or "extern_kernels.addmm(" in x for x in lines[i + 1:wait])
    return count


@pytest.mark.slow
def test_inductor_runs_the_functional_collectives_under_matmuls_and_equals_one_process():
    ranks = run_ranks(tensor_parallel_ranks.inductor, 2, timeout=1800, collective_timeout=900)
    loss, grads = single(zoo.build("llama-tiny"))
    for rank in ranks:
        for case in ("tp", "sequence", "async"):
            torch.testing.assert_close(rank[case]["loss"], loss, **LOSS)
            assert_gradients_equal(rank[case]["grads"], grads)
            for role, found in rank[case]["collectives"].items():
                assert found["picofx"] == [] and found["issues"] > 0 and found["unwaited"] == 0, (case, role)
            assert rank[case]["collectives"]["backward"]["under a matmul"] >= 5, case
    assert issued_then_a_matmul_then_waited(ranks[0]["code"]) >= 5  # the backward's, as the graph placed them


def test_tied_embedding_and_head_share_one_row_split(llama_ranks):
    result = llama_ranks[0]["tied"]
    tied = [n for n, p in result["placements"].items() if n in ("model.embed_tokens.weight", "lm_head.weight")]
    assert tied and all(result["placements"][n] == "S(0)" for n in tied)
    assert all(result["local_shapes"][n] == (128, 64) for n in tied)


def test_a_plan_tp_cannot_run_is_refused_before_anything_communicates():
    with pytest.raises(ValueError, match="plan"):
        TensorParallel(plan={"*.q_proj.weight": "sideways"})


def test_adamw_clipping_and_a_dcp_checkpoint_work_unchanged(two_ranks):
    ranks, directory = two_ranks["adamw_and_checkpoint"], two_ranks["directory"]
    z = zoo.build("llama-tiny")
    optimizer = torch.optim.AdamW(z.model.parameters(), lr=1e-3)
    for _ in range(3):
        single(z)
        torch.nn.utils.clip_grad_norm_(z.model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_trained_and_saved_as(ranks, z.model, directory)


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_fuse_after_it_fuses_every_site_on_the_pieces_and_keeps_the_numbers(backend, request):
    ranks = request.getfixturevalue("two_ranks")["with_fuse"] if backend == "eager" else \
        run_ranks(tensor_parallel_ranks.with_fuse, 2, backend, timeout=900, collective_timeout=600)
    loss, grads = single(zoo.build("llama-tiny"))
    for rank in ranks:
        assert rank["fused"]["swiglu"] == 2
        assert rank["fused"]["grouped_query_attention"] == 2 and rank["fused"]["rms_norm"] == 5
        torch.testing.assert_close(rank["loss"], loss, **LOSS)
        assert_gradients_equal(rank["grads"], grads)


def test_data_parallel_times_tensor_parallel_on_one_mesh_of_four_ranks(four_ranks):
    ranks = four_ranks["with_data_parallel"]
    z = zoo.build("llama-tiny", batch=2, seed=0)
    batches = [{k: v.roll(r * 3, dims=-1).contiguous() for k, v in dict(z.example_inputs).items()} for r in (0, 1)]
    later = [{k: v.roll(1, dims=-1).contiguous() for k, v in batch.items()} for batch in batches]
    losses, summed, accumulated = [], {}, {}
    for batch, next_batch in zip(batches, later):  # the replicas' batches one after the other
        z.model.zero_grad(set_to_none=True)
        loss = z.loss_fn(z.model(batch["input_ids"]), batch["labels"])
        loss.backward()
        losses.append(loss.detach())
        for n, p in z.model.named_parameters():
            summed[n] = summed.get(n, 0) + p.grad / 2
        z.loss_fn(z.model(next_batch["input_ids"]), next_batch["labels"]).backward()  # accumulated on top
        for n, p in z.model.named_parameters():
            accumulated[n] = accumulated.get(n, 0) + p.grad / 2
    assert sorted(r["replica"] for r in ranks) == [0, 0, 1, 1]
    for rank in ranks:
        torch.testing.assert_close(rank["loss"], losses[rank["replica"]], **LOSS)
        assert_gradients_equal(rank["grads"], summed)
        assert_gradients_equal(rank["accumulated"], accumulated)  # no_sync's gradients are DTensors too


def test_sharded_data_parallel_times_tensor_parallel_in_any_order_stores_a_quarter_and_trains_as_one_process(
        four_ranks):
    """dp_shard 2 x tp 2: parameters 2-D DTensors (FSDP2 over TP), the dp ranks on halves of the batch.
    [Shard, TensorParallel] and [fuse, Shard, TensorParallel] run as fuse_loss (which tensor_parallel
    requires), tensor_parallel, fuse, shard and equal one process; then 3 AdamW steps with clipping, and the DCP checkpoint loaded into the
    plain model."""
    from overlap_ranks import later_batch

    ranks, directory = four_ranks["with_shard"], four_ranks["directory"]
    z = zoo.build("llama-tiny", batch=4)
    loss, grads = single(z)
    for order, ran in (("shard first", ["fuse_loss", "tensor_parallel", "shard"]),
                       ("fuse first", ["fuse_loss", "tensor_parallel", "fuse", "shard"])):
        torch.testing.assert_close(torch.stack([r[order]["loss"] for r in ranks]).mean(), loss, **LOSS)
        for rank in ranks:
            assert rank[order]["ran"] == ran
            assert "tensor_parallel before shard: tensor_parallel declares runs_before='shard'" in \
                rank[order]["pass order"]
            assert_gradients_equal(rank[order]["grads"], grads)
        # the backward's reduce-scatters wait behind the next bucket beside tp's collectives, every
        # rank by the first rank's choice
        schedules = [rank[order]["schedule"] for rank in ranks]
        assert schedules[0][0]["waited_after_next_bucket"] > 0
        moved = [[{k: v for k, v in s.items() if k != "predicted_backward_peak"} for s in sch] for sch in schedules]
        assert all(m == moved[0] for m in moved)
    for rank in ranks:
        assert rank["local_bytes"] <= rank["whole_bytes"] // 4 + 4096  # norms: half over dp_shard, whole over tp
    placements = ranks[0]["placements"]
    assert placements["decoder_layers.0.attention.q_proj.weight"] == "[_StridedShard(dim=0, sf=2), Shard(dim=0)]"
    assert placements["decoder_layers.0.attention.out_proj.weight"] == "[Shard(dim=0), Shard(dim=1)]"
    assert placements["decoder_layers.0.input_layernorm.weight"] == "[Shard(dim=0), Replicate()]"
    z = zoo.build("llama-tiny", batch=4)
    optimizer = torch.optim.AdamW(z.model.parameters(), lr=1e-3)
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        single(zoo.ZooModel(z.model, later_batch(z.example_inputs, step + 5), z.loss_fn))
        torch.nn.utils.clip_grad_norm_(z.model.parameters(), max_norm=1.0)
        optimizer.step()
    assert_trained_and_saved_as(ranks, z.model, directory)


def test_tensor_parallel_listed_before_pipeline_runs_after_it_on_four_ranks_and_equals_one_process(four_ranks):
    ranks = four_ranks["with_pipeline"]
    z = zoo.build("llama-tiny", batch=4)
    loss, grads = single(z)
    held = set()
    for rank in ranks:
        torch.testing.assert_close(rank["loss"], loss, **LOSS)
        assert "pipeline before tensor_parallel: tensor_parallel declares runs_after='pipeline'" in rank["pass order"]
        assert rank["placed"] and rank["local_bytes"] < rank["whole_bytes"] * 0.6
        assert_gradients_equal(rank["grads"], grads, names=rank["grads"])
        held |= set(rank["grads"])
    assert held == set(grads)  # every parameter on some stage


@pytest.fixture(scope="module")
def uneven_ranks(four_ranks):
    return four_ranks["uneven"]


@pytest.mark.parametrize("case, build", [
    ("kv", lambda: zoo.build("llama-tiny")),
    ("vocab", lambda: zoo.build("llama-tiny", vocab_size=257)),
    ("tied vocab", lambda: real_models.hf_model("llama", vocab_size=257, tie_word_embeddings=True))])
def test_heads_and_vocabularies_tp_does_not_divide_equal_one_process(uneven_ranks, case, build):
    """tp=4: the 2 key/value heads replicated (each rank slicing the repeated heads its query head
    reads), a vocabulary of 257 padded to 260 with the padded logits masked out of the loss."""
    loss, grads = single(build())
    for rank in uneven_ranks:
        result = rank[case]
        torch.testing.assert_close(result["loss"], loss, **LOSS)
        assert_gradients_equal(result["grads"], grads)
    placements, plan = uneven_ranks[0][case]["placements"], uneven_ranks[0][case]["plan"]
    if case == "kv":
        assert placements["decoder_layers.0.attention.k_proj.weight"] == "R"
        assert placements["decoder_layers.0.attention.q_proj.weight"] == "S(0)"
        assert "key/value heads not divisible by tp=4" in plan
    else:
        padded = uneven_ranks[0][case]["notes"]["padded"]
        assert len(padded) == (1 if case == "tied vocab" else 2) and all("257 rows padded to 260" in p for p in padded)
        shapes = uneven_ranks[3][case]["local_shapes"]  # the last rank: 65 rows less 3 padded
        head = next(n for n in ("lm_head.weight", "final_proj.weight", "model.embed_tokens.weight") if n in shapes)
        assert shapes[head][0] == 62


def test_pipeline_times_sharded_data_parallel_times_tensor_parallel_on_eight_ranks_equals_one_process():
    ranks = run_ranks(tensor_parallel_ranks.three_dimensional, 8, timeout=900, collective_timeout=600)
    z = zoo.build("llama-tiny", batch=8)
    loss, grads = single(z)
    held = set()
    for rank in ranks:
        assert set(rank["placements"].values()) == {2}  # every parameter a (dp_shard, tp) DTensor
        assert rank["local_bytes"] < rank["whole_bytes"] * 0.3  # 1/4 of its stage, plus replicated norms
        assert_gradients_equal(rank["grads"], grads, names=rank["grads"])
        held |= set(rank["grads"])
    replicas = [r["loss"] for r in ranks[:4:2]]  # ranks 0 and 2: pp 0, tp 0, dp_shard 0 and 1
    torch.testing.assert_close(sum(replicas) / 2, loss, **LOSS)
    assert held == set(grads)


def test_shapes_tp_cannot_split_are_refused_by_name_or_kept_whole_and_still_equal_one_process(two_ranks):
    result = two_ranks["awkward_shapes"][0]
    assert "decoder_layers.0.mlp.gate_proj.weight has 97 rows, which tp=2 does not divide" in result["rows"]
    assert result["rows seconds"] < 60  # raised at the forward stage, before anything communicates
    for case, whole in (("heads", "q_proj"), ("kv groups", "k_proj")):
        loss, grads = single(zoo.build("llama-tiny", **tensor_parallel_ranks.AWKWARD_HEADS[case]))
        torch.testing.assert_close(result[case]["loss"], loss, **LOSS)
        assert_gradients_equal(result[case]["grads"], grads)
        placements = result[case]["placements"]
        assert placements[f"decoder_layers.0.attention.{whole}.weight"] == "R"
        assert placements["decoder_layers.0.mlp.up_proj.weight"] == "S(0)"
