"""Each codec is one record beside its class (kind, spelling, example, lossy, traffic figure), listed
by one line in picofx/compression/registry.py; parsing, the planner's pricing and the combination
table read the records. A codec added by its registry line alone is spelled, planned and priced."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from picofx.compression import Dense, parse_compress, registry
from picofx.cost.device import devices
from picofx.manager import combinations
from picofx.passes import Overlap, Shard
from picofx.planner import compress as planned
from picofx.planner.layouts import Layout
from picofx.planner.models import model_config

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Half(Dense):
    """A codec a user adds: the bucket in fp16 (Dense's exchange, another cast)."""

    cast: torch.dtype | None = torch.float16
    kind, spelling, example, lossy = "half", '"half"', "half", True
    traffic_per_element = 7
    label = "half"

    @classmethod
    def parse(cls, argument):
        return cls() if argument is None else None


def test_every_registered_codec_parses_its_example_into_its_class_and_is_listed_everywhere():
    assert [c.kind for c in registry.CODECS] == ["bf16", "int8", "topk", "powersgd"]
    for codec in registry.CODECS:
        made = parse_compress(codec.example).other
        assert type(made) is codec and made.label == codec.example
        assert codec.spelling in registry.kinds_text()
        assert combinations.COMPRESS_SPELLING[codec.kind] == codec.example and codec.kind in combinations.COMPRESSION
        assert (codec.kind in planned.default_kinds()) is not codec.lossy
    assert [c.kind for c in registry.CODECS if c.lossy] == ["topk", "powersgd"]
    assert parse_compress("int8:ef").other.traffic_per_element > parse_compress("int8").other.traffic_per_element > 0
    assert Dense().traffic_per_element == 0


def test_a_codec_added_by_its_registry_line_is_spelled_planned_and_priced_by_its_record(monkeypatch):
    with pytest.raises(ValueError, match="'half' is not a compressor"):
        parse_compress("half")
    monkeypatch.setattr(registry, "CODECS", (*registry.CODECS, Half))
    assert parse_compress("sparse_rows+half").other == Half()
    assert Overlap(compress="half").spec.other == Half() and Shard(compress="half").compress == "half"
    with pytest.raises(ValueError, match=re.escape('"powersgd:R" (R >= 1), "half", "sparse_rows"')):
        parse_compress("half:2")
    assert "half" not in planned.default_kinds()  # lossy: planned only when asked
    assert planned.kinds_to_consider("half") == ("half",)
    config, h100 = model_config("llama-tiny"), devices()["h100"]
    table, others = planned.gradient_shapes(config, 1, 1)
    elements = sum(torch.Size(s).numel() for s in [table, *others])
    exchange = planned.exchange(config, Layout(4, 1, 1, compress="half"), 16, h100, h100.inter_node_link)
    assert exchange.wire_bytes == Half().wire_bytes([table, *others], 4, 4)
    assert exchange.compute_s == pytest.approx(7 * elements / h100.memory_bandwidth)


def test_the_architecture_page_lists_the_files_a_codec_touches_and_each_codec_lives_in_one_module():
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = page.split("### Adding a codec", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^\d\. `([^`]+)`", section, flags=re.M)
    assert listed == ["picofx/compression/<name>.py", "picofx/compression/registry.py",
                      "tests/compression/test_<name>.py"]
    for codec in registry.CODECS:  # each codec's class, with its record, in a module of its own
        module = codec.__module__.split(".")
        assert module[:2] == ["picofx", "compression"]
        assert (ROOT / "picofx" / "compression" / f"{module[2]}.py").is_file()
