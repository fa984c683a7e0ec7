"""optimize(progress=...): one line per step of capture and compilation, as each finishes, with its time."""
import dataclasses
import re

import torch

import picofx
from picofx.models.llama import CONFIGS, Llama, causal_lm_loss


def tiny_batch():
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(CONFIGS["tiny"], vocab_size=64, num_hidden_layers=1))
    ids = torch.randint(0, 64, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def mark_nodes(gm, ctx):
    for node in gm.graph.nodes:
        node.meta["seen_by_mark_nodes"] = True
    return picofx.PassResult(changed=False)


def test_each_step_is_told_in_order_with_its_time(capsys):
    model, batch = tiny_batch()
    lines = []
    opt = picofx.optimize(model, batch, passes=[mark_nodes], backend="eager", loss_fn=causal_lm_loss,
                          progress=lines.append)
    expected = [r"capturing the training step$",
                r"captured in [\d.]+ s \(\d+ nodes\)$",
                r"pass mark_nodes \(forward\) in [\d.]+ s: (\d+) -> \1 nodes$",
                r"traced the backward .* in [\d.]+ s \(\d+ nodes\)$",
                r"partitioned into a forward and a backward graph in [\d.]+ s",
                r"ran the forward graph's passes in [\d.]+ s; backward graph: \d+ nodes$",
                r"ready to run the graphs \(backend eager\) in [\d.]+ s; ([\d.]+) s in all$"]
    assert len(lines) == len(expected), lines
    for line, pattern in zip(lines, expected):
        assert line.startswith("picofx: ") and re.search(pattern, line), (line, pattern)
    total = float(re.search(r"([\d.]+) s in all", lines[-1]).group(1))
    assert total >= sum(float(x) for x in re.findall(r"in ([\d.]+) s", " ".join(lines[:-1]))) - 0.5
    assert capsys.readouterr().out == ""  # told to the function given, nothing printed besides
    lines.clear()
    opt(input_ids=batch["input_ids"][:1], labels=batch["labels"][:1])  # a new shape: told again
    assert lines[0] == "picofx: capturing the training step" and "in all" in lines[-1], lines


def test_without_progress_nothing_is_said(capsys):
    model, batch = tiny_batch()
    picofx.optimize(model, batch, passes=[mark_nodes], backend="eager", loss_fn=causal_lm_loss)
    assert capsys.readouterr().out == ""


def test_a_graph_from_the_cache_is_told_as_loaded(monkeypatch, tmp_path):
    monkeypatch.setenv("PICOFX_CACHE", "1")
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path))
    told = []
    for _ in range(2):
        model, batch = tiny_batch()
        lines = []
        picofx.optimize(model, batch, passes=["fuse"], backend="eager", loss_fn=causal_lm_loss,
                        progress=lines.append)
        told.append(lines)
    assert told[0][0] == "picofx: capturing the training step" and told[0][1].startswith("picofx: captured in")
    assert told[1][0] == "picofx: loading the optimized graph from the cache", told[1]
    assert re.fullmatch(r"picofx: loaded in [\d.]+ s \(\d+ nodes, the forward passes already run\)", told[1][1])
    assert "in all" in told[1][-1]
