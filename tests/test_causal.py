"""picofx.capture.causal: which masks are proven causal (computed from constants alone, the tril when
evaluated), why the others are not, and erasing a mask's computation once nothing reads it."""
import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from picofx.capture.causal import erase_unread, is_causal_mask, why_not_causal

T = 6
ONES = dict(size=(T, T), dtype=torch.bool)


def hugging_face(x):  # positions compared, as transformers' sdpa_mask does, then expanded per batch
    return (torch.arange(T).view(1, 1, 1, T) <= torch.arange(T).view(1, 1, T, 1)).expand(2, 1, T, T)


def additive_tril(x):
    return torch.where(torch.ones(**ONES).tril(), 0.0, float("-inf"))


def meta_reference(x):  # Meta's llama: -inf above the diagonal, added to the scores
    return torch.triu(torch.full((T, T), float("-inf")), diagonal=1)


def lowest_float(x):  # Hugging Face's eager mask: the dtype's lowest number where masked
    return torch.where(torch.ones(**ONES).tril(), 0.0, torch.finfo(torch.float32).min)


def window(x):
    return torch.ones(**ONES).tril() & torch.ones(**ONES).triu(-2)


def upper_triangle(x):
    return torch.ones(**ONES).triu()


def read_from_an_input(x):  # a padding mask: causal only while the input is positive
    return torch.ones(**ONES).tril() & (x > 0)


def random(x):  # the tril whatever the draw, but a random op is no constant
    return torch.ones(**ONES).tril() & (torch.rand(T, T) >= 0)


def finite_bias(x):  # -1 above the diagonal: attended to, with a bias
    return torch.where(torch.ones(**ONES).tril(), 0.0, -1.0)


def one_batch_entry_padded(x):
    tril = torch.ones(**ONES).tril()
    return torch.stack([tril, tril & (torch.arange(T) > 0)]).view(2, 1, T, T)


def written_in_place(x):  # the tril, then a key masked in place (a graph not made functional)
    mask = torch.ones(**ONES).tril()
    mask[:, 0] = False
    return mask


MASKS = {hugging_face: True, additive_tril: True, meta_reference: True, lowest_float: True, window: False,
         upper_triangle: False, read_from_an_input: False, random: False, finite_bias: False,
         one_batch_entry_padded: False, written_in_place: False}


def traced(make_mask) -> fx.Node:
    return make_fx(make_mask)(torch.randn(T, T)).graph.output_node().args[0]


@pytest.mark.parametrize("make_mask", MASKS, ids=[f.__name__ for f in MASKS])
def test_a_mask_is_proven_causal_only_when_it_is_computed_from_constants_and_is_the_tril(make_mask):
    assert is_causal_mask(traced(make_mask)) is MASKS[make_mask]


def test_the_reason_names_the_input_or_the_value():
    assert "the graph's input x_1" in why_not_causal(traced(read_from_an_input))
    assert "the random or in-place op" in why_not_causal(traced(random))
    assert "is not the causal tril" in why_not_causal(traced(window))


def test_under_a_fake_mode_the_mask_is_still_evaluated_on_real_tensors():
    mask = traced(hugging_face)
    with FakeTensorMode():
        assert is_causal_mask(mask)


def test_erase_unread_erases_the_mask_and_what_only_it_reads():
    def graph_of(x):
        positions = torch.arange(T)
        mask = positions.view(1, T) <= positions.view(T, 1)
        return mask, x + positions  # the positions have another reader

    gm = make_fx(graph_of)(torch.randn(T))
    output = gm.graph.output_node()
    mask = output.args[0][0]
    output.args = ((None, output.args[0][1]),)
    assert erase_unread(gm.graph, [mask]) == 3  # le and the two views; arange stays, read by the add
    assert [str(n.target) for n in gm.graph.nodes if n.op == "call_function"] == [
        "aten.arange.default", "aten.add.Tensor"]
    assert erase_unread(gm.graph, [n for n in gm.graph.nodes if n.op == "placeholder"]) == 0
