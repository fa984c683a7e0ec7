import operator
from dataclasses import dataclass

import pytest
import torch

import picofx
from picofx.models import zoo
from picofx.manager import Context, GraphRole, PassInfo, PassManager, Stage, SyncMode
from picofx.testing import assert_trains_like_eager, captured, count_ops, run_pass

aten = torch.ops.aten


@pytest.fixture(scope="module")
def llama():
    return zoo.build("llama-tiny")


def add_as_sub_of_neg(gm, ctx):
    """a + b -> a - (-b): the same numbers, one node more per add."""
    adds = [n for n in gm.graph.nodes if n.target is aten.add.Tensor and isinstance(n.args[1], torch.fx.Node)]
    for node in adds:
        with gm.graph.inserting_before(node):
            negated = gm.graph.call_function(aten.neg.default, (node.args[1],))
            sub = gm.graph.call_function(aten.sub.Tensor, (node.args[0], negated))
        node.replace_all_uses_with(sub)
        gm.graph.erase_node(node)
    return picofx.PassResult(changed=bool(adds), notes={"rewritten": len(adds)})


def add_as_sub(gm, ctx):
    """Deliberately wrong: a + b -> a - b."""
    for node in gm.graph.nodes:
        if node.target is aten.add.Tensor and isinstance(node.args[1], torch.fx.Node):
            node.target = aten.sub.Tensor
    return picofx.PassResult(changed=True)


def test_manager_records_time_counts_and_node_changes(llama):
    gm, ctx = captured(llama)
    adds = sum(1 for n in gm.graph.nodes if n.target is aten.add.Tensor and isinstance(n.args[1], torch.fx.Node))
    before = len(gm.graph.nodes)
    record = run_pass(add_as_sub_of_neg, gm, ctx)
    assert record.name == "add_as_sub_of_neg" and record.seconds > 0
    assert record.nodes_before == before and record.nodes_after == before + adds
    assert len(record.added) == 2 * adds and len(record.removed) == adds
    assert record.notes == {"rewritten": adds}
    assert count_ops(gm, aten.neg.default) >= adds
    assert all("val" in n.meta for n in gm.graph.nodes if n.op != "output")  # re-annotated


def test_numerics_verification_catches_a_wrong_pass_and_rolls_back(llama):
    gm, ctx = captured(llama)
    code_before = gm.code
    with pytest.raises(picofx.PassError, match=r"pass 'add_as_sub' \(forward stage.*failed verification.*differs"):
        run_pass(add_as_sub, gm, ctx)
    assert gm.code == code_before
    assert all("val" in n.meta for n in gm.graph.nodes if n.op != "output")


def test_a_communicating_pass_is_not_compared_on_one_rank_and_says_so(llama):
    """Its graph computes this rank's part (averaged gradients, pieces of parameters), which the
    graph before it cannot equal; the report says the numerics were not compared and why."""
    def exchange(gm, ctx):
        return add_as_sub(gm, ctx)

    exchange.info = PassInfo(Stage.FORWARD, communicates=True)
    gm, ctx = captured(llama)
    record = run_pass(exchange, gm, ctx)
    assert record.notes["numerics"].startswith("not compared: this rank's graph computes its part")


def test_a_pass_that_raises_leaves_the_graph_intact(llama):
    gm, ctx = captured(llama)
    code_before = gm.code

    def half_done(gm, ctx):
        first = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
        first.target = aten.mul.Tensor
        raise RuntimeError("gave up halfway")

    with pytest.raises(picofx.PassError, match="half_done.*raised: RuntimeError: gave up halfway"):
        run_pass(half_done, gm, ctx, verify="invariants")
    assert gm.code == code_before


def test_a_pass_must_return_a_pass_result(llama):
    gm, ctx = captured(llama)
    with pytest.raises(picofx.PassError, match="returns PassResult"):
        run_pass(lambda gm, ctx: None, gm, ctx)


def test_invariants_catch_copied_weights(llama):
    gm, ctx = captured(llama)

    def copy_a_weight(gm, ctx):
        gm.register_parameter("stolen", torch.nn.Parameter(torch.zeros(2)))
        return picofx.PassResult(changed=True)

    with pytest.raises(picofx.PassError, match="parameters of its own"):
        run_pass(copy_a_weight, gm, ctx, verify="invariants")


def test_unknown_pass_name_lists_the_available_ones():
    with pytest.raises(KeyError, match="unknown pass 'fusee'; available passes:"):
        PassManager(["fusee"])


def test_dataclass_pass_with_options_declared_at_the_joint_stage(llama):
    @dataclass(frozen=True)
    class CountNodes:
        label: str = "nodes"
        info = PassInfo(Stage.JOINT)

        def __call__(self, gm, ctx):
            return picofx.PassResult(notes={self.label: len(gm.graph.nodes), "role": ctx.graph_role})

    opt = picofx.optimize(llama.model, llama.example_inputs, [CountNodes("joint_nodes")], backend="eager",
                          loss_fn=llama.loss_fn)
    (record,) = opt.report.records
    assert record.stage is Stage.JOINT and record.notes["role"] is GraphRole.JOINT
    assert record.notes["joint_nodes"] == len(opt.graphs["joint"].graph.nodes)


def test_joint_stage_numerics_catch_a_wrong_pass(llama):
    def scale_gradients(gm, ctx):
        out = gm.graph.output_node()
        grads = list(out.args[0])
        first = next(i for i, g in enumerate(grads) if isinstance(g, torch.fx.Node) and i > 0)
        with gm.graph.inserting_before(out):
            grads[first] = gm.graph.call_function(aten.mul.Tensor, (grads[first], 2.0))
        out.args = (type(out.args[0])(grads),)
        return picofx.PassResult(changed=True)

    scale_gradients.info = PassInfo(Stage.JOINT)
    with pytest.raises(picofx.PassError, match="scale_gradients' \\(joint stage, joint graph\\) failed verification"):
        picofx.optimize(llama.model, llama.example_inputs, [scale_gradients], backend="eager",
                        loss_fn=llama.loss_fn, verify="numerics")


def test_instruments_see_every_graph_and_dump_files(tmp_path, llama):
    calls = []

    class Recorder:
        def on_graph(self, label, gm, ctx):
            calls.append(("graph", label))

        def after_pass(self, record, gm, ctx):
            calls.append(("pass", record.name))

    opt = picofx.optimize(llama.model, llama.example_inputs, [add_as_sub_of_neg], backend="eager",
                          loss_fn=llama.loss_fn, instruments=[Recorder()], dump_dir=str(tmp_path))
    assert calls == [("graph", "captured"), ("pass", "add_as_sub_of_neg"), ("graph", "joint"),
                     ("graph", "partitioned.forward"), ("graph", "partitioned.backward")]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[:4] == ["00_captured.dot", "00_captured.txt", "01_add_as_sub_of_neg.dot", "01_add_as_sub_of_neg.txt"]
    assert "03_partitioned.forward.txt" in names and "04_partitioned.backward.txt" in names
    text = (tmp_path / "01_add_as_sub_of_neg.txt").read_text()
    assert "aten.sub.Tensor" in text and "decoder_layers.0" in text
    assert opt.report.records[0].notes["rewritten"] > 0


def test_rewritten_graph_still_trains_like_eager(llama):
    assert_trains_like_eager(zoo.build("hf-llama-tiny"), [add_as_sub_of_neg], verify="numerics")


def mean_from_var_mean(gm, ctx):
    """x.mean(dim, keepdim) -> var_mean(x, dim, keepdim)[1]: a new multi-output node and its getitem,
    created without meta (the manager annotates them)."""
    means = [n for n in gm.graph.nodes if n.target is aten.mean.dim]
    for node in means:
        x, dims, keepdim = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else False
        with gm.graph.inserting_before(node):
            both = gm.graph.call_function(aten.var_mean.correction, (x, dims), {"correction": 0, "keepdim": keepdim})
            mean = gm.graph.call_function(operator.getitem, (both, 1))
        node.replace_all_uses_with(mean)
        gm.graph.erase_node(node)
    return picofx.PassResult(changed=bool(means), notes={"rewritten": len(means)})


def test_getitem_and_multi_output_nodes_survive_annotation(llama):
    gm, ctx = captured(llama)
    getitems = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert getitems and all(isinstance(n.meta["val"], torch.Tensor) for n in getitems)
    mean_shapes = [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.target is aten.mean.dim]
    record = run_pass(mean_from_var_mean, gm, ctx)  # numerics verified: the same means
    assert record.notes["rewritten"] == len(mean_shapes) > 0
    pairs = [n for n in gm.graph.nodes if n.target is aten.var_mean.correction]
    assert [tuple(n.meta["val"][1].shape) for n in pairs] == mean_shapes
    assert all(isinstance(n.meta["val"], tuple) and len(n.meta["val"]) == 2 and n.meta["bytes"] > 0 for n in pairs)
    new_getitems = [u for n in pairs for u in n.users]
    assert [tuple(n.meta["val"].shape) for n in new_getitems] == mean_shapes
    assert all(n.meta["module_path"] for n in new_getitems)  # the path their inputs share


def drop_logits(gm, ctx):
    out = gm.graph.output_node()
    loss, _ = out.args[0]
    out.args = ((loss, None),)
    return picofx.PassResult(changed=True)


def test_an_output_dropped_to_none_is_skipped_by_numerics_and_returned_as_none():
    z = zoo.build("hf-llama-tiny")
    opt = picofx.optimize(z.model, z.example_inputs, [drop_logits], backend="eager", verify="numerics")
    out = opt(**z.example_inputs)
    assert out.logits is None and out.loss.shape == ()


def scale_loss(factor):
    def scale(gm, ctx):
        out = gm.graph.output_node()
        (loss,) = out.args[0]
        with gm.graph.inserting_before(out):
            scaled = gm.graph.call_function(aten.mul.Tensor, (loss, factor))
        out.args = ((scaled,),)
        return picofx.PassResult(changed=True, tolerance=(1e-2, 0.0), normwise=True)
    return scale


def test_normwise_tolerance_bounds_each_tensor_by_its_norm(llama):
    gm, ctx = captured(llama)
    run_pass(scale_loss(1.005), gm, ctx)  # 0.5% everywhere: within 1% of every norm
    gm, ctx = captured(llama)
    with pytest.raises(picofx.PassError, match="norm-wise"):
        run_pass(scale_loss(1.05), gm, ctx)


def test_a_pass_that_declares_it_only_tags_is_held_to_it():
    """tags_only skips the graph copy and re-annotation; a pass that then adds a node fails and its tags go."""
    import picofx
    from picofx.manager import PassInfo
    from picofx.models.zoo import build

    class Tags:
        info = PassInfo(picofx.Stage.JOINT, tags_only=True)

        def __init__(self, add_node: bool):
            self.add_node = add_node

        def __call__(self, gm, ctx):
            for node in gm.graph.nodes:
                node.meta["tagged"] = True
            if self.add_node:
                first = next(n for n in gm.graph.nodes if n.op == "call_function")
                with gm.graph.inserting_after(first):
                    gm.graph.call_function(torch.ops.aten.clone.default, (first,))
            return picofx.PassResult(True, {})

    z = build("llama-tiny")
    opt = picofx.optimize(z.model, z.example_inputs, [Tags(add_node=False)], backend="eager", loss_fn=z.loss_fn)
    assert all(n.meta.get("tagged") for n in opt.graphs["joint"].graph.nodes if n.op != "output")
    with pytest.raises(picofx.PassError, match=r"declares PassInfo\(tags_only=True\) but changed"):
        picofx.optimize(z.model, z.example_inputs, [Tags(add_node=True)], backend="eager", loss_fn=z.loss_fn)


def test_a_context_given_mode_strings_holds_the_enums_passes_compare_with():
    ctx = Context(model=torch.nn.Linear(1, 1), example_inputs=[], device=torch.device("cpu"),
                  graph_role="backward", gradient_sync="local")
    assert ctx.graph_role is GraphRole.BACKWARD and ctx.gradient_sync is SyncMode.LOCAL
    assert f"{ctx.graph_role} graph" == "backward graph"  # printed as the word it was
    with pytest.raises(ValueError, match="'sideways' is not a valid GraphRole"):
        Context(model=None, example_inputs=[], device=torch.device("cpu"), graph_role="sideways")
