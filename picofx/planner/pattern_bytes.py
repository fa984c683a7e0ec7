"""Memory traffic of a training step per fused pattern, against the unfused ops each replaces, at
a real model's shape on fake tensors (nothing is allocated; a Llama-3.1-8B step counts on a laptop).

Two steps of the same model are captured and partitioned as Inductor partitions them
(`picofx.planner.predict.predict`): one after `fuse`, one without it. In both, each forward node
is tagged with the fuse rule that replaced it (in the fused step: the nodes a rule inserted; in the
unfused one: the nodes a rule would replace, found by running the rules on a copy of the graph),
and the tag follows each node into the backward graph. Each step's bytes are then counted kernel
by kernel as Inductor runs them (`picofx.cost.inductor.traffic`) and summed per tag: a rule's
row is what its fused ops move against what the ops they replace move, counted the same way;
"other" is everything no rule touches. The step is counted at 1 and 2 layers of the real width;
per layer = the difference, the rest = what 1 layer adds beyond that, and `layers` layers =
rest + layers x per layer, for bytes and kernels alike.

The device is passed to the passes through the cost model on ctx (a rule that sizes its work by
the device, as the fused loss's chunks, sees it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from picofx.api import optimize
from picofx.capture.vocabulary import module_path
from picofx.cost.device import devices
from picofx.cost.inductor.traffic import decomposed, traffic_by_label
from picofx.cost.model import CostModel
from picofx.kernels.linear_cross_entropy import linear_cross_entropy_decomposed
from picofx.manager import PassInfo, PassResult, Stage
from picofx.passes.fuse.fuse import Fuse
from picofx.planner.predict import InductorPartition, fake_mode
from picofx.rewrite.matcher import prepare

TAG = "fused_pattern"  # the key in node.meta["custom"], which AOT copies to the backward's nodes
OTHER = "other"
SHAPES = {  # Hugging Face LlamaConfig fields, and the batch and sequence the step is counted at
    "llama-3.2-1b": (dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                          tie_word_embeddings=True), 4, 2048),
    "llama-3.1-8b": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                          tie_word_embeddings=False), 1, 8192),
}


def pattern_of(node: fx.Node) -> str:
    return (node.meta.get("custom") or {}).get(TAG) or OTHER


def _tag(node: fx.Node, name: str) -> None:
    node.meta["custom"] = {**(node.meta.get("custom") or {}), TAG: name}


def _within(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix + ".")


@dataclass(frozen=True)
class TaggedFuse:
    """`fuse`, one rule at a time in the registry's order (what `fuse` does), tagging the nodes
    each rule inserts with its name."""

    info = PassInfo(Stage.FORWARD, runs_before=("precision",))

    def __call__(self, gm: fx.GraphModule, ctx) -> PassResult:
        notes = {}
        prepare(gm.graph, Fuse().selected_rules())  # one export traces what every rule checks first
        for rule in Fuse().selected_rules():
            before = set(gm.graph.nodes)
            notes[rule.name] = Fuse(rules=(rule,))(gm, ctx).notes[rule.name]
            for node in gm.graph.nodes:
                if node not in before and node.op == "call_function":
                    _tag(node, rule.name)
        return PassResult(any(notes.values()), notes)


@dataclass(frozen=True)
class TagReplaced:
    """Tags each node with the rule that would replace it, changing nothing: the rules run on a
    copy, and a node a rule removes there is the rule's, or the later rule's that removes what the
    first put in its place (add_rms_norm takes an rms_norm with the residual add). What a rule
    inserts stands for the removed nodes within its module path."""

    info = PassInfo(Stage.FORWARD, runs_before=("precision",), tags_only=True)

    def __call__(self, gm: fx.GraphModule, ctx) -> PassResult:
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))  # nodes keep their names; values are shared, not copied
        work = fx.GraphModule(gm, graph)
        origins = {node: {node.name} for node in work.graph.nodes}
        owner: dict[str, str] = {}
        prepare(work.graph, Fuse().selected_rules())
        for rule in Fuse().selected_rules():
            before = set(work.graph.nodes)
            Fuse(rules=(rule,))(work, ctx)
            after = set(work.graph.nodes)
            removed = [n for n in before if n not in after]
            for node in removed:
                for name in origins[node]:
                    owner[name] = rule.name
            for node in after - before:
                path = module_path(node)
                origins[node] = set().union(*(origins[r] for r in removed if _within(module_path(r), path)))
        for node in gm.graph.nodes:
            if node.name in owner:
                _tag(node, owner[node.name])
        return PassResult(False, {"tagged": len(owner)})


def hf_llama(shape: str, layers: int):
    """Hugging Face's LlamaForCausalLM at `shape`'s width with `layers` layers, in bf16, on fake
    tensors, and its (input_ids, labels) batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"pattern bytes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    fields, batch, seq = SHAPES[shape]
    config = LlamaConfig(**{**fields, "num_hidden_layers": layers}, max_position_embeddings=seq, rms_norm_eps=1e-5,
                         use_cache=False, attn_implementation="sdpa")
    default = torch.get_default_dtype()
    with fake_mode():
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


def inherit_tags(gm: fx.GraphModule) -> None:
    """A backward node AOT made without a forward node to copy the tag from takes the tag its
    inputs share (a sum of two gradients of the loss's logits is the loss's): one step only, from
    tags the nodes had, so that a tag does not spread down the whole backward."""
    tagged = {node: pattern_of(node) for node in gm.graph.nodes if TAG in (node.meta.get("custom") or {})}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in tagged:
            continue
        tags = {tagged.get(arg, OTHER) for arg in node.all_input_nodes if arg.op == "call_function"}
        if len(tags) == 1 and OTHER not in tags:
            _tag(node, tags.pop())


def step_traffic(model, inputs, fused: bool, gpu: str = "h200") -> dict[str, dict]:
    """{pattern: {"read", "written", "kernels"}} of one training step (forward and backward).
    On a GPU the fused ops run as the opaque kernels CUDA calls, so the graphs are counted as
    captured; on "cpu", after the decompositions Inductor applies there (the pointwise fused ops
    among them)."""
    if gpu not in devices():
        raise ValueError(f"pattern bytes: unknown device {gpu!r}; choose from {', '.join(devices())}")
    cost_model = CostModel(devices()[gpu], fuses_pointwise=gpu == "cpu")
    opt = optimize(model, inputs, [TaggedFuse() if fused else TagReplaced(), InductorPartition()], backend="eager",
                   verify=None, cost_model=cost_model)
    graphs = [opt.graphs["forward"], opt.graphs["backward"]]
    if gpu != "cpu":  # as CUDA lowers them (the CPU's table decomposed them already): the pointwise
        # fused ops as their Triton kernels, the loss decomposed
        loss = {torch.ops.picofx.linear_cross_entropy.default: linear_cross_entropy_decomposed}
        graphs = [decomposed(g, loss) for g in graphs]
    inherit_tags(graphs[1])
    return traffic_by_label(graphs, pattern_of)


def _scaled(one: dict, two: dict, layers: int) -> dict:
    """Per pattern and figure: the rest + `layers` x per layer, from counts at 1 and 2 layers."""
    out = {}
    for name in {*one, *two}:
        a, b = one.get(name, {}), two.get(name, {})
        out[name] = {k: (2 * a.get(k, 0) - b.get(k, 0)) + layers * (b.get(k, 0) - a.get(k, 0))
                     for k in ("read", "written", "kernels")}
    return out


def pattern_bytes(shape: str, layers: int | None = None, gpu: str = "h200", counted_layers=(1, 2)) -> dict:
    """The step's traffic per pattern, fused and unfused, at `layers` layers (default: the model's)
    from counts at `counted_layers` (two counts scale by layer; one is taken as it is)."""
    fields, batch, seq = SHAPES[shape]
    layers = layers or fields["num_hidden_layers"]
    counts = {"fused": [], "unfused": []}
    for n in counted_layers:
        model, inputs = hf_llama(shape, n)
        for variant in counts:
            counts[variant].append(step_traffic(model, inputs, variant == "fused", gpu))
    if len(counted_layers) == 2:
        scaled = {v: _scaled(*c, layers) for v, c in counts.items()}
    else:
        layers = counted_layers[0]
        scaled = {v: c[0] for v, c in counts.items()}
    return {"shape": shape, "batch": batch, "seq": seq, "layers": layers, "counted_layers": list(counted_layers),
            "gpu": gpu, "dtype": "bfloat16", **scaled}


def rows(result: dict) -> list[dict]:
    """One row per pattern (rules that fired, then "other", then the step): bytes moved fused and
    unfused, kernels each."""
    fused, unfused = result["fused"], result["unfused"]
    names = sorted(n for n in {*fused, *unfused} if n != OTHER) + [OTHER]
    out = []
    for name in [*names, "step"]:
        parts = [name] if name != "step" else names
        f = {k: sum(fused.get(p, {}).get(k, 0) for p in parts) for k in ("read", "written", "kernels")}
        u = {k: sum(unfused.get(p, {}).get(k, 0) for p in parts) for k in ("read", "written", "kernels")}
        out.append({"pattern": name, "fused": f, "unfused": u,
                    "fused_bytes": f["read"] + f["written"], "unfused_bytes": u["read"] + u["written"]})
    return out


def table(result: dict) -> str:
    head = ["pattern", "fused GB (r+w)", "kernels", "unfused GB (r+w)", "kernels", "fused - unfused GB"]
    lines = [head]
    for row in rows(result):
        f, u = row["fused"], row["unfused"]
        lines.append([row["pattern"], f"{f['read'] / 1e9:.2f}+{f['written'] / 1e9:.2f}", str(f["kernels"]),
                      f"{u['read'] / 1e9:.2f}+{u['written'] / 1e9:.2f}", str(u["kernels"]),
                      f"{(row['fused_bytes'] - row['unfused_bytes']) / 1e9:+.2f}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "-" * len(text[0]))
    title = (f"{result['shape']}: {result['batch']} x {result['seq']} tokens, {result['layers']} layers, bf16, "
             f"device {result['gpu']}; bytes per training step (forward + backward) as Inductor runs it")
    return title + "\n" + "\n".join(text)
