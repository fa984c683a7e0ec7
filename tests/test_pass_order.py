"""The order passes run in: declared in their PassInfo, sorted by the manager, the caller's order
kept where no declaration speaks; only a real conflict is refused, naming the passes."""
import pytest

import picofx
from picofx.manager import PassInfo, PassManager, Stage, pass_name, register_pass
from picofx.manager.passes import PASSES
from picofx.models import zoo
from picofx.passes import Pipeline, Shard, TensorParallel


def declared(name: str, **info):
    """A pass that does nothing, named `name`, declared with PassInfo(**info)."""
    def noop(gm, ctx):
        return picofx.PassResult()

    noop.__name__ = name
    noop.info = PassInfo(**info)
    return noop


def run_order(passes) -> list[str]:
    return [pass_name(p) for p in PassManager(passes).passes]


@pytest.mark.parametrize("given", [[Shard(), TensorParallel()], [TensorParallel(), Shard()]])
def test_tensor_parallel_runs_before_shard_in_either_order_given(given):
    assert run_order(given) == ["fuse_loss", "tensor_parallel", "shard"]  # fuse_loss: tensor_parallel requires it


@pytest.mark.parametrize("given", [["shard", "fuse"], ["fuse", "shard"]])
def test_shard_runs_after_fuse_in_either_order_given(given):
    assert run_order(given) == ["fuse", "shard"]


def test_every_layout_pass_lands_where_its_declarations_put_it():
    given = ["shard", "precision", "fuse", TensorParallel(), Pipeline(stages=2, microbatches=2), "checkpoint"]
    assert run_order(given) == ["pipeline", "fuse_loss", "tensor_parallel", "fuse", "precision", "shard", "checkpoint"]


def test_the_order_given_stays_where_no_constraint_speaks():
    passes = [declared("c"), declared("a"), PASSES["checkpoint"](), declared("b"), PASSES["overlap"](), "fuse"]
    manager = PassManager(passes)
    assert manager.passes[:5] == passes[:5] and run_order(passes) == ["c", "a", "checkpoint", "b", "overlap", "fuse"]
    assert manager.order_changes is None
    assert PassManager(manager.passes).passes == manager.passes  # sorting the sorted order changes nothing


def test_a_moved_pass_leaves_the_others_in_their_given_order():
    given = [declared("x"), Shard(), declared("y"), TensorParallel(), declared("z")]
    assert run_order(given) == ["x", "y", "fuse_loss", "tensor_parallel", "shard", "z"]


def test_a_required_pass_is_added_once_before_the_first_that_requires_it_and_the_report_says_so():
    needs_a = [declared("x"), declared("b", requires=("a",)), declared("c", requires=("a",))]
    try:
        register_pass("a", PassInfo(runs_after=("x",)))(lambda gm, ctx: picofx.PassResult())
        manager = PassManager(needs_a)
        assert [pass_name(p) for p in manager.passes] == ["x", "a", "b", "c"]
        assert manager.order_changes == "given x, b, c; run as x, a, b, c\n  added a: b declares requires='a'"
        given_late = PassManager([declared("b", requires=("a",)), PASSES["a"]()])  # given: not added again
        assert [pass_name(p) for p in given_late.passes] == ["a", "b"]
        assert "b declares requires='a'" in given_late.order_changes
    finally:
        PASSES.pop("a", None)
    with pytest.raises(ValueError, match=r"pass 'b' declares requires=\['nowhere'\], but no pass is registered "
                                         r"under that name"):
        PassManager([declared("b", requires=("nowhere",))])


def test_a_cycle_is_refused_naming_both_passes():
    first, second = declared("first", runs_before=("second",)), declared("second", runs_before=("first",))
    with pytest.raises(ValueError, match=r"passes 'first' and 'second' cannot both run: their declared order is a "
                                         r"cycle \(first declares runs_before='second'; second declares "
                                         r"runs_before='first'\)"):
        PassManager([first, second])
    third = declared("third", runs_after=("second",), runs_before=("first",))
    with pytest.raises(ValueError, match=r"passes 'third', 'first', 'second' cannot all run"):
        PassManager([third, declared("first", runs_before=("second",)), declared("second")])


def test_a_constraint_the_stages_break_is_refused_naming_both_passes():
    late = declared("late", stage=Stage.PARTITIONED, runs_before=("fuse",))
    with pytest.raises(ValueError, match=r"passes 'late' and 'fuse' cannot both run: late declares "
                                         r"runs_before='fuse', but 'late' runs at the partitioned stage"):
        PassManager(["fuse", late])
    early = declared("early", stage=Stage.FORWARD, runs_before=("overlap",))  # the stages already honour it
    assert run_order(["overlap", early]) == ["overlap", "early"]


def test_two_passes_that_each_split_the_step_are_refused_naming_both():
    splitter = declared("splitter", splits_graph=True)
    with pytest.raises(ValueError, match=r"passes \['pipeline', 'splitter'\] each split the step"):
        PassManager([Pipeline(stages=2, microbatches=2), splitter])


def test_a_declaration_is_a_tuple_of_names():
    with pytest.raises(TypeError, match=r"runs_before=\('shard',\)"):
        PassInfo(runs_before="shard")


def test_a_pass_declares_its_stage_once_in_its_pass_info():
    def joint_pass(gm, ctx):
        return picofx.PassResult()

    joint_pass.stage = Stage.JOINT  # not read: refused, saying how to declare it
    with pytest.raises(ValueError, match=r"declares `stage = Stage.JOINT`.*info = PassInfo\(Stage.JOINT\)"):
        PassManager([joint_pass])
    del joint_pass.stage
    try:
        registered = register_pass("joint_noop", PassInfo(Stage.JOINT, runs_before=("checkpoint",)))(joint_pass)
        assert registered.info.stage is Stage.JOINT
        assert run_order(["checkpoint", "joint_noop"]) == ["joint_noop", "checkpoint"]
    finally:
        PASSES.pop("joint_noop", None)


def test_reordered_passes_run_as_in_the_declared_order_and_the_report_says_why():
    """precision listed before fuse runs after it, as listed the other way: the same passes fire,
    the same graph comes out, and the report names the declaration that moved them."""
    runs = {}
    for given in (["fuse", "precision"], ["precision", "fuse"]):
        z = zoo.build("llama-tiny", seq=8)
        opt = picofx.optimize(z.model, z.example_inputs, given, backend="eager", loss_fn=z.loss_fn)
        runs[given[0]] = opt
    as_declared, moved = runs["fuse"], runs["precision"]
    assert [r.name for r in moved.report.records] == [r.name for r in as_declared.report.records]
    fused = next(r.notes for r in moved.report.records if r.name == "fuse")
    assert fused["swiglu"] == 2 and fused["linear_cross_entropy"] == 1
    assert moved.graph_module.code == as_declared.graph_module.code
    assert "pass order" not in as_declared.report.sections
    assert moved.report.sections["pass order"] == ("given precision, fuse; run as fuse, precision\n"
                                                   "  fuse before precision: fuse declares runs_before='precision'")
    assert "pass order:\ngiven precision, fuse; run as fuse, precision" in moved.report.table()

