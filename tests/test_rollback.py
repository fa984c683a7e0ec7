"""Rollback never crashes: whatever a pass does to its graph, optimize raises PassError naming the
pass and its stage, the model is untouched, and the next optimize of the same model equals eager.

Each breaking pass below corrupts whichever graph it is given (captured forward, joint, or a
partitioned forward/backward graph) through fx's public node API, as a buggy rewrite would."""
import re

import pytest
import torch
from torch import fx

import picofx
from picofx.models import zoo
from picofx.manager import PassInfo, Stage, register_pass
from picofx.manager.passes import PASSES, RegisteredPass, pass_name, pass_stage
from picofx.testing import assert_trains_like_eager, captured, run_pass

# (stage, graph role): every graph a pass can be given on one process
PLACES = [(Stage.FORWARD, "forward"), (Stage.JOINT, "joint"), (Stage.PARTITIONED, "forward"),
          (Stage.PARTITIONED, "backward")]


def computed(gm):
    """The first call_function node that takes a node and has users: there is one in every graph."""
    return next(n for n in gm.graph.nodes if n.op == "call_function" and n.all_input_nodes and n.users)


def make_cycle(gm):
    node = computed(gm)
    user = next(iter(node.users))
    node.replace_input_with(node.all_input_nodes[0], user)  # node -> user -> node


def erase_under_users(gm):
    node = computed(gm)
    node.users.clear()  # so that erase_node lets it go; its users still take it
    gm.graph.erase_node(node)


def take_from_another_graph(gm):
    other = fx.Graph()
    stranger = other.placeholder("stranger")
    node = computed(gm)
    node.replace_input_with(node.all_input_nodes[0], stranger)


def forget_users(gm):
    computed(gm).users.clear()  # a dead-code sweep would then erase it under its users


BREAKS = {"cycle": make_cycle, "erased_under_users": erase_under_users,
          "argument_of_another_graph": take_from_another_graph, "forgotten_users": forget_users}
# what the verifier says when the pass returns the broken graph without raising
VERDICTS = {"cycle": "the graph has a cycle: ", "erased_under_users": "which is no longer in the graph",
            "argument_of_another_graph": "a node of another graph", "forgotten_users": r"\.users does not list it"}


def breaking_pass(break_graph, stage, role, *, raises: bool):
    def broken(gm, ctx):
        if ctx.graph_role == role:
            break_graph(gm)
            if raises:
                raise RuntimeError("gave up halfway")
        return picofx.PassResult(changed=True)

    return RegisteredPass(broken, f"break_{break_graph.__name__}", PassInfo(stage))


@pytest.fixture(scope="module")
def llama():
    return zoo.build("llama-tiny", seq=8, num_hidden_layers=1, hidden_size=32, intermediate_size=64, vocab_size=64)


def state_of(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model, state, parameters):
    assert type(model) is zoo.Llama and all(p.grad is None for p in model.parameters())
    assert [id(p) for p in model.parameters()] == parameters
    after = model.state_dict()
    assert after.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)


def optimize_fails(llama, broken, verify="invariants"):
    for p in llama.model.parameters():
        p.grad = None  # the fixture's model trained in the test before
    state, parameters = state_of(llama.model), [id(p) for p in llama.model.parameters()]
    with pytest.raises(picofx.PassError) as info:
        picofx.optimize(llama.model, llama.example_inputs, [broken], backend="eager", loss_fn=llama.loss_fn,
                        verify=verify)
    assert_untouched(llama.model, state, parameters)
    return info


@pytest.mark.parametrize("stage,role", PLACES, ids=[f"{s.value}-{r}" for s, r in PLACES])
@pytest.mark.parametrize("kind", BREAKS)
def test_a_broken_graph_is_never_kept(llama, kind, stage, role):
    broken = breaking_pass(BREAKS[kind], stage, role, raises=True)
    where = f"pass '{broken.pass_name}' ({stage.value} stage, {role} graph)"
    info = optimize_fails(llama, broken)  # breaks the graph, then raises
    assert str(info.value).startswith(f"{where} raised: RuntimeError: gave up halfway")
    assert "left as it was before" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError) and str(info.value.__cause__) == "gave up halfway"

    info = optimize_fails(llama, breaking_pass(BREAKS[kind], stage, role, raises=False))  # returns it broken
    assert str(info.value).startswith(f"{where} failed verification: VerificationError: ")
    assert isinstance(info.value.__cause__, picofx.VerificationError)
    assert re.search(VERDICTS[kind], str(info.value)), str(info.value)

    assert_trains_like_eager(llama, [], batches=[llama.example_inputs])


@pytest.mark.slow
@pytest.mark.parametrize("stage,role", PLACES[1:], ids=[f"{s.value}-{r}" for s, r in PLACES[1:]])
def test_under_inductor_the_error_is_the_pass_error(llama, stage, role):
    """Inductor runs the joint and partitioned stages in its own hooks and wraps what they raise."""
    broken = breaking_pass(make_cycle, stage, role, raises=False)
    with pytest.raises(picofx.PassError, match=f"pass 'break_make_cycle' \\({stage.value} stage, {role} graph\\) "
                                               "failed verification: .*the graph has a cycle"):
        picofx.optimize(llama.model, llama.example_inputs, [broken], backend="inductor", loss_fn=llama.loss_fn)


@pytest.mark.parametrize("kind", BREAKS)
def test_the_restored_graph_is_the_one_before_the_pass(llama, kind):
    gm, ctx = captured(llama)
    code, graph = gm.code, gm.graph
    with pytest.raises(picofx.PassError, match="gave up halfway"):
        run_pass(breaking_pass(BREAKS[kind], Stage.FORWARD, "forward", raises=True), gm, ctx)
    assert gm.graph is not graph and gm.graph.owning_module is gm  # replaced wholesale, not mended
    gm.graph.lint()
    assert gm.code == code
    assert all("val" in n.meta for n in gm.graph.nodes if n.op != "output")
    run_pass(lambda gm, ctx: picofx.PassResult(), gm, ctx)  # the restored graph runs, numerics checked


def test_attributes_a_failing_pass_added_are_dropped(llama):
    gm, ctx = captured(llama)

    def add_weight_then_raise(gm, ctx):
        gm.register_buffer("scratch", torch.zeros(2))
        raise ValueError("no")

    with pytest.raises(picofx.PassError, match="add_weight_then_raise.*ValueError: no"):
        run_pass(add_weight_then_raise, gm, ctx)
    assert not hasattr(gm, "scratch")


def test_one_function_registered_twice_gives_two_passes():
    def count_nodes(gm, ctx):
        return picofx.PassResult(notes={"nodes": len(gm.graph.nodes)})

    try:
        first = register_pass("count_forward_nodes")(count_nodes)
        second = register_pass("count_joint_nodes", Stage.JOINT)(first)
        third = register_pass("count_backward_nodes", Stage.PARTITIONED)(count_nodes)
        made = [PASSES[name]() for name in ("count_forward_nodes", "count_joint_nodes", "count_backward_nodes")]
        assert [(pass_name(p), pass_stage(p)) for p in made] == [
            ("count_forward_nodes", Stage.FORWARD), ("count_joint_nodes", Stage.JOINT),
            ("count_backward_nodes", Stage.PARTITIONED)]
        assert made == [first, second, third] and not hasattr(count_nodes, "stage")
        z = zoo.build("llama-tiny", seq=8)
        opt = picofx.optimize(z.model, z.example_inputs, ["count_joint_nodes", "count_forward_nodes"],
                              backend="eager", loss_fn=z.loss_fn)
        assert [(r.name, r.stage) for r in opt.report.records] == [
            ("count_forward_nodes", Stage.FORWARD), ("count_joint_nodes", Stage.JOINT)]
    finally:
        for name in ("count_forward_nodes", "count_joint_nodes", "count_backward_nodes"):
            PASSES.pop(name, None)


def test_a_class_registered_twice_keeps_each_name():
    class Noop:
        info = PassInfo(Stage.JOINT)

        def __call__(self, gm, ctx):
            return picofx.PassResult()

    try:
        first = register_pass("noop_first")(Noop)
        second = register_pass("noop_second")(Noop)
        assert (pass_name(first()), pass_name(second())) == ("noop_first", "noop_second")
        assert pass_stage(first()) is pass_stage(second()) is Stage.JOINT and isinstance(second(), Noop)
        with pytest.raises(ValueError, match="Noop is a class, which declares itself"):
            register_pass("noop_third", Stage.FORWARD)(Noop)
    finally:
        for name in ("noop_first", "noop_second", "noop_third"):
            PASSES.pop(name, None)
