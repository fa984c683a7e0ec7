"""Rules' patterns kept on disk load back as the very graphs tracing gives, and the fuse pass uses
them through optimize's cache directory."""
import dataclasses

import torch

from picofx.models import zoo
from picofx.passes.fuse.fuse import Fuse
from picofx.rewrite import registered_rules
from picofx.rewrite.pattern_store import PatternStore, rule_key
from picofx.rewrite.rules import Traces, trace_patterns
from picofx.testing import assert_trains_like_eager

ROUNDING = (1e-5, 1e-5)  # the fused kernels sum in another order than the unfused ops (as tests/passes/test_fuse.py)


def _fresh(rule):
    copy = dataclasses.replace(rule)
    object.__setattr__(copy, "traces", Traces())
    return copy


def _described(rule) -> list:
    return [(p.variant, str(p.graph), sorted(p.inputs.values()),
             repr([(n.op, n.name, n.target, n.args, n.kwargs) for n in p.graph.nodes])) for p in rule.traces.patterns]


def test_stored_patterns_load_as_traced(tmp_path):
    store = PatternStore(tmp_path)
    traced = [_fresh(r) for r in registered_rules()]
    trace_patterns(traced, store)
    assert len(list(tmp_path.glob("*.patterns"))) == len(traced)
    loaded = [_fresh(r) for r in registered_rules()]
    for rule in loaded:
        rule.traces.patterns = store.load(rule)
        assert rule.traces.patterns is not None, rule.name
    for a, b in zip(traced, loaded):
        assert _described(a) == _described(b), a.name


def test_key_follows_what_the_trace_depends_on():
    rule = registered_rules()[0]
    other_inputs = dataclasses.replace(rule, variants=[*rule.variants, {"dtype": torch.float16}])
    assert rule_key(rule) == rule_key(_fresh(rule))
    assert rule_key(other_inputs) != rule_key(rule)
    assert rule_key(dataclasses.replace(rule, pattern=lambda x: x)) != rule_key(rule)
    made = {}
    exec("def pattern(x):\n    return x\n", made)  # noqa: S102  a function with no source file, as in a notebook
    assert rule_key(dataclasses.replace(rule, pattern=made["pattern"])) is None  # not stored: traced each time


def test_unreadable_file_is_traced_again(tmp_path):
    rule = _fresh(registered_rules()[0])
    (tmp_path / f"{rule_key(rule)}.patterns").write_bytes(b"torn")
    store = PatternStore(tmp_path)
    assert store.load(rule) is None
    trace_patterns([rule], store)
    assert store.load(_fresh(rule)) is not None


def test_fuse_through_the_store_trains_like_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("PICOFX_CACHE", "1")
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path))
    kept = {rule: rule.traces for rule in registered_rules()}
    try:
        for _ in range(2):  # the first run stores the patterns, the second loads them
            for rule in kept:  # the pass traces through the store, not from this process's traces
                object.__setattr__(rule, "traces", Traces())
            opt = assert_trains_like_eager(zoo.build("llama-tiny"), [Fuse()], backend="eager", tolerance=ROUNDING)
            assert sum(opt.report.records[0].notes[rule.name] for rule in kept) > 0
            assert len(list(tmp_path.glob("*.patterns"))) == len(kept)
    finally:
        for rule, traces in kept.items():
            object.__setattr__(rule, "traces", traces)
