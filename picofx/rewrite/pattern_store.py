"""Rules' traced patterns kept on disk, so that a process does not trace them again.

Tracing every rule's patterns costs seconds (one torch.export of all of them), the same in every
process. A `PatternStore` keeps each rule's pattern graphs in a file named by a digest of what
the trace depends on: the rule's pattern source (and its module's), inputs and variants, the
tracing code and decompositions, and the torch version. A rule whose source cannot be read
(one defined in a notebook cell) is traced every time; an unreadable file is ignored and rewritten.
"""
from __future__ import annotations

import hashlib
import inspect
import os
import pickle
from pathlib import Path

import torch
from torch import fx

import picofx.capture.export as capture_export
from picofx.capture.graph_data import add_nodes, node_records
import picofx.rewrite.rules as rules_module
import picofx.rewrite.tracing as tracing_module

FORMAT = 2


def _source(obj) -> str | None:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


def _describe(value) -> str:
    """A text for `value` that is the same in every process (a function by its name, not its address)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return repr(value)


def rule_key(rule) -> str | None:
    """The digest naming the file of `rule`'s patterns; None when the rule's source is unknown."""
    module = inspect.getmodule(rule.pattern)
    parts = [_source(rule.pattern), module and _source(module)]
    if any(p is None for p in parts):
        return None
    parts += [_describe(dict(rule.inputs)), _describe([dict(v) for v in rule.variants]), torch.__version__, str(FORMAT)]
    parts += [_source(m) or "" for m in (capture_export, rules_module, tracing_module)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def dump_pattern(pattern) -> tuple:
    return pattern.variant, node_records(pattern.graph.nodes), [(p.name, name) for p, name in pattern.inputs.items()]


def load_pattern(data: tuple):
    variant, nodes, inputs = data
    graph = fx.Graph()
    env = add_nodes(graph, nodes)
    return rules_module.Pattern(variant, graph, {env[node]: name for node, name in inputs})


class PatternStore:
    """Pattern graphs as files `<key>.patterns` in `directory`."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def load(self, rule) -> list | None:
        key = rule_key(rule)
        path = key and self.directory / f"{key}.patterns"
        if not path or not path.exists():
            return None
        try:
            return [load_pattern(p) for p in pickle.loads(path.read_bytes())]
        except Exception:  # a torn file, or one an older picofx wrote: trace again
            return None

    def save(self, rule, patterns: list) -> None:
        key = rule_key(rule)
        if key is None:
            return
        try:
            data = pickle.dumps([dump_pattern(p) for p in patterns])
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = self.directory / f"{key}.{os.getpid()}.tmp"
            partial.write_bytes(data)
            os.replace(partial, self.directory / f"{key}.patterns")  # readers never see half a file
        except (OSError, TypeError, pickle.PicklingError, AttributeError):
            return  # not stored: traced again next time
