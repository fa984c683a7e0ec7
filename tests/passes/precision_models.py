"""Small modules and graph helpers for the `precision` tests."""
import torch
import torch.nn.functional as F
from torch import fx, nn

from picofx.capture.export import KEPT_WHOLE, LossStep, quiet_export
from picofx.models.zoo import ZooModel
from picofx.manager import copy_graph
from picofx.passes.precision.rules import RULES, op_name

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
RULE_OF = {op: rule.name for rule in RULES for op in rule.ops}


def calls(gm, *rules):
    return [n for n in gm.graph.nodes if n.op == "call_function" and RULE_OF.get(op_name(n.target)) in rules]


def dtype(node):
    return node.meta["val"].dtype


def float_inputs(node):
    return [a for a in node.all_input_nodes
            if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].is_floating_point()]


def float_casts(gm):
    """Casts between floating dtypes: (source node, dtype) for each."""
    return [(n.args[0], n.kwargs["dtype"]) for n in gm.graph.nodes
            if n.target is torch.ops.aten._to_copy.default and "dtype" in n.kwargs
            and n.args[0].meta["val"].is_floating_point() and n.kwargs["dtype"] != n.args[0].meta["val"].dtype]


def graph_copy(gm):
    copied = fx.GraphModule(gm, copy_graph(gm.graph))
    copied.meta.update(gm.meta)
    return copied


def linears_by_module(gm):
    return {n.meta["module_path"]: dtype(n) for n in calls(gm, "matmul")}


def model_loss(z: ZooModel, model, batch: dict):
    """The loss of `model` (z.model or a copy of it) on a batch, the way z's step computes it."""
    if z.loss_fn is None:
        return model(**batch).loss
    return z.loss_fn(model(**{k: v for k, v in batch.items() if k != "labels"}), batch["labels"])


def relative_errors(grads, reference):
    return [((g - r).norm() / r.norm()).item() for g, r in zip(grads, reference)]


def autocast_graph(z: ZooModel) -> fx.GraphModule:
    """The same step exported under torch.autocast(bf16), lowered as picofx.capture lowers."""
    step = z.model if z.loss_fn is None else LossStep(z.model, z.loss_fn)

    class Autocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.step = step

        def forward(self, **inputs):
            with torch.autocast("cpu", BF16):
                return self.step(**inputs)

    table = torch.export.default_decompositions()
    for op in KEPT_WHOLE:
        del table[op]
    with quiet_export():
        exported = torch.export.export(Autocast(), (), dict(z.example_inputs), strict=False)
        return exported.run_decompositions(table).graph_module


class RuleToy(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 10)
        self.register_buffer("inv_freq", torch.rand(1, 8))

    def forward(self, x, mask, labels):
        h = self.norm(self.proj(x))  # (B, T, C)
        positions = torch.arange(x.shape[1], dtype=torch.float32)[:, None]
        angles = positions @ self.inv_freq  # (T, 8): a matmul on no weight, table arithmetic
        table = torch.cat((angles.cos(), angles.sin()), -1)  # (T, 16)
        q = (h * table).unflatten(-1, (2, 8)).transpose(1, 2)  # (B, H, T, D)
        att = F.scaled_dot_product_attention(q, q, q, attn_mask=mask).transpose(1, 2).flatten(2)
        logits = self.head(torch.sigmoid(att) * h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class FusedToy(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(16))
        self.up = nn.Linear(16, 32, bias=False)
        self.head = nn.Linear(16, 10, bias=False)

    def forward(self, x, cos, sin, labels):
        total, h = torch.ops.picofx.add_rms_norm(x, x, self.norm_weight, 1e-5)
        a, b = self.up(torch.ops.picofx.rms_norm(h, self.norm_weight, 1e-5)).chunk(2, -1)
        m = torch.ops.picofx.silu_mul(a, b)  # (B, T, 16)
        q, k = torch.ops.picofx.rope(m, m, cos, sin)
        loss, *_ = torch.ops.picofx.linear_cross_entropy(q + k + total, self.head.weight, None, labels,
                                                         -100, "mean", False)  # upcast=False
        return loss


class EqualDtypes(nn.Module):
    """index_put wants its values in the dtype of the tensor it writes into."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.row = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.proj(x)  # bf16 after the pass; self.row stays fp32
        return h.index_put((torch.tensor([0]),), self.row).sum()


class Cancellation(nn.Module):
    """`coarse` sums inputs with a large common offset through weight rows that sum to zero: its
    bf16 output is mostly rounding error. `fine` is an ordinary projection."""

    def __init__(self):
        super().__init__()
        self.fine = nn.Linear(32, 32, bias=False)
        self.coarse = nn.Linear(32, 32, bias=False)
        with torch.no_grad():
            self.coarse.weight -= self.coarse.weight.mean(1, keepdim=True)

    def forward(self, x, target):
        return F.mse_loss(self.coarse(x + 100.0) + self.fine(x), target)
