import copy

import pytest
import torch

import picofx
from picofx.models import zoo
from picofx.testing import assert_trains_like_eager


@pytest.mark.parametrize("name", ["llama-tiny", "hf-llama-tiny", "gpt2-tiny"])
def test_no_passes_trains_exactly_like_eager(name):
    assert_trains_like_eager(zoo.build(name), [], verify="numerics")


def test_hugging_face_output_object_is_kept():
    z = zoo.build("hf-llama-tiny")
    opt = picofx.optimize(z.model, z.example_inputs, backend="eager")
    out = opt(**z.example_inputs)
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert out.loss.shape == () and out.logits.shape == (2, 32, z.model.config.vocab_size)
    assert opt.config is z.model.config  # attributes fall through to the model


def test_state_dict_keys_values_and_checkpoint_round_trip(tmp_path):
    z = zoo.build("llama-tiny")
    plain_keys = list(z.model.state_dict())
    opt = picofx.optimize(z.model, z.example_inputs, backend="eager", loss_fn=z.loss_fn)
    assert list(opt.state_dict()) == plain_keys
    assert all(a is b for a, b in zip(opt.parameters(), z.model.parameters()))
    optimizer = torch.optim.AdamW(z.model.parameters(), lr=1e-2)  # built on the original model
    before = {k: v.clone() for k, v in z.model.state_dict().items()}
    opt(**z.example_inputs).backward()
    optimizer.step()
    assert any(not torch.equal(before[k], v) for k, v in opt.state_dict().items())
    torch.save(opt.state_dict(), tmp_path / "ckpt.pt")
    fresh = zoo.build("llama-tiny", seed=7).model
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    for (k, a), b in zip(fresh.state_dict().items(), opt.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)


def test_new_shape_recaptures_and_stays_exact():
    z = zoo.build("llama-tiny", seq=16)
    reference = copy.deepcopy(z.model)
    opt = picofx.optimize(z.model, z.example_inputs, backend="eager", loss_fn=z.loss_fn)
    first = opt.graph_module
    longer = zoo.build("llama-tiny", seq=24, seed=3).example_inputs
    loss = opt(**longer)
    expected = z.loss_fn(reference(longer["input_ids"]), longer["labels"])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert len(opt._steps) == 2 and opt.report.input_key != ()
    # The new step is captured for the new shape: its key and its graph's inputs say 24, not 16.
    batch = z.example_inputs["input_ids"].shape[0]
    assert opt.report.input_key[1:] == (("tensor", (batch, 24), torch.int64, "cpu"),) * 2  # input_ids, labels
    assert opt.graph_module is not first
    assert [tuple(n.meta["val"].shape) for n in opt.graph_module.graph.nodes
            if n.op == "placeholder" and n.meta["val"].dtype == torch.int64] == [(batch, 24)] * 2
    # The first shape again: its step is reused, not captured a third time, and it is still exact.
    loss = opt(**z.example_inputs)
    assert opt.graph_module is first and len(opt._steps) == 2
    torch.testing.assert_close(loss, z.loss_fn(reference(z.example_inputs["input_ids"]), z.example_inputs["labels"]),
                               rtol=1e-5, atol=1e-6)


def test_new_shape_without_recapture_names_the_dimension():
    z = zoo.build("llama-tiny", seq=16)
    opt = picofx.optimize(z.model, z.example_inputs, backend="eager", loss_fn=z.loss_fn, recapture=False)
    longer = zoo.build("llama-tiny", seq=24).example_inputs
    with pytest.raises(picofx.InputShapeError,
                       match=r"input_ids has shape \(2, 24\), but .* captured with \(2, 16\) \(dimension 1: 24 vs 16\)"):
        opt(**longer)


def test_eval_mode_gets_its_own_graph():
    z = zoo.build("llama-tiny")
    opt = picofx.optimize(z.model, z.example_inputs, backend="eager", loss_fn=z.loss_fn)
    training = opt.graphs
    assert list(training) == ["joint", "forward", "backward"]
    opt.eval()
    assert not z.model.training
    with torch.no_grad():
        loss = opt(**z.example_inputs)
        expected = z.loss_fn(z.model(z.example_inputs["input_ids"]), z.example_inputs["labels"])
    assert len(opt._steps) == 2
    assert list(opt.graphs) == ["forward"]  # captured in eval mode: a forward graph, no backward
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    opt.train()
    opt(**z.example_inputs)
    assert opt.graphs is training and len(opt._steps) == 2  # back in training: the training step again


def test_report_lists_every_pass_with_stage_and_counts():
    z = zoo.build("llama-tiny")

    def noop(gm, ctx):
        return picofx.PassResult(changed=False, notes={"seen": len(gm.graph.nodes)})

    opt = picofx.optimize(z.model, z.example_inputs, [noop], backend="eager", loss_fn=z.loss_fn)
    table = opt.report.table()
    assert "noop" in table and "seen=" in table and "capture" in table and "compile (eager)" in table
    record = opt.report.records[0]
    assert record.nodes_before == record.nodes_after == len(opt.graph_module.graph.nodes)


def test_inductor_training_step_matches_eager_and_runs_every_stage():
    z = zoo.build("llama-tiny")
    seen = []

    def watch(stage):
        def watcher(gm, ctx):
            seen.append((ctx.stage, ctx.graph_role))
            return picofx.PassResult()
        watcher.info = picofx.manager.PassInfo(stage)
        return watcher

    passes = [watch(s) for s in picofx.Stage]
    assert_trains_like_eager(z, passes, backend="inductor", verify="numerics")
    assert seen == [(picofx.Stage.FORWARD, "forward"), (picofx.Stage.JOINT, "joint"),
                    (picofx.Stage.PARTITIONED, "forward"), (picofx.Stage.PARTITIONED, "backward")]


def test_picofx_ops_inductor_does_not_decompose_are_declared_fallbacks():
    from torch._inductor.lowering import lowerings

    from picofx.runtime.compile import declare_fallbacks, inductor_decompositions

    decompositions = inductor_decompositions(torch.device("cpu"))
    declare_fallbacks(decompositions)
    ops = [getattr(torch.ops.picofx, name.split("::")[1]).default
           for name in torch._C._dispatch_get_all_op_names() if name.startswith("picofx::")]
    assert torch.ops.picofx.linear_cross_entropy.default in ops
    for op in ops:
        assert (op in lowerings) != (op in decompositions), op
