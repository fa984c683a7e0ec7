"""The planner's captures kept on disk (picofx.planner.store): a second plan of the same model and
sequence reads them instead of capturing, with equal costs; anything else captures."""
from __future__ import annotations

import pytest

from picofx.cost.device import devices
from picofx.cost.model import CostModel
from picofx.planner import costs
from picofx.planner.models import model_config
from picofx.planner.store import CaptureStore


@pytest.fixture
def store_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PICOFX_CACHE", "1")
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "CAPTURED", {})
    return tmp_path


def tiny_costs(seq: int = 16):
    return costs.model_costs(model_config("llama-tiny"), seq, CostModel(devices()["h100"]), costs.PASSES)


def no_capture(*args, **kwargs):
    raise AssertionError("captured again")


def test_a_second_process_reads_the_captures_and_gets_the_same_costs(store_on, monkeypatch):
    first = tiny_costs()
    assert len(list(store_on.glob("*.capture"))) == 2  # one decoder layer and two
    monkeypatch.setattr(costs, "CAPTURED", {})  # as a new process starts
    monkeypatch.setattr(costs.plan, "predict", no_capture)
    assert tiny_costs() == first
    with pytest.raises(AssertionError, match="captured again"):
        tiny_costs(seq=24)  # another sequence is another capture


def test_an_unreadable_or_other_entry_is_not_used(tmp_path):
    store = CaptureStore(tmp_path)
    store.save(("a key",), {"costs": 1})
    assert store.load(("a key",)) == {"costs": 1} and store.load(("another key",)) is None
    store.path(("a key",)).write_bytes(b"not a pickle")
    assert store.load(("a key",)) is None
    assert not list(tmp_path.glob("*.tmp"))  # each save renamed its partial file into place


def test_picofx_cache_0_turns_the_store_off_and_the_cache_directory_holds_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PICOFX_CACHE", "0")
    assert CaptureStore.from_environment() is None
    monkeypatch.setenv("PICOFX_CACHE", "1")
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path))
    assert CaptureStore.from_environment().directory == tmp_path
