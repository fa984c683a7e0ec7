"""The precision policy as data: which ops compute in the low-precision dtype, which stay fp32.

Each rule names a group of ops and the dtype class its nodes get:

    "compute"  the policy's compute dtype (bf16 or fp16, or a module override): every floating
               input is cast to it, so the op runs in it. Matmuls, attention, and the fused ops
               whose kernels accumulate in fp32 inside (silu_mul, linear_cross_entropy).
    "output"   the op takes its floating inputs as they come and writes its output in the compute
               dtype through its `out_dtype` argument: the fused norms, which read the fp32
               residual stream and fp32 weight, compute in fp32 and round once at the end, as the
               unfused norm does under autocast (there the next matmul's cast rounds it).
    "fp32"     the fp32 islands: every low-precision input is cast up to fp32. Norm statistics,
               softmax, RoPE tables, losses: reductions and exponentials that bf16's 8-bit
               mantissa ruins.

A node whose floating input the model itself upcast to fp32 (an explicit `.float()` captured as
a cast from bf16/fp16) is never lowered: the model asked for that op in fp32.

Every other op follows its inputs (ATen type promotion), as under torch.autocast: a residual
add of an fp32 stream and a bf16 matmul output stays fp32; views and pointwise ops of bf16 values
stay bf16. Ops are named "namespace.op" and matched on the overload packet.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from picofx.capture.vocabulary import viewed_source
from picofx.capture.vocabulary import input_slot

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str  # "compute", "output" or "fp32"
    ops: tuple[str, ...]


RULES = (
    Rule("matmul", "compute", ("aten.linear", "aten.mm", "aten.bmm", "aten.addmm", "aten.matmul", "aten.baddbmm",
                               "aten.addbmm", "aten.mv", "aten.addmv", "aten.dot", "aten.convolution",
                               "aten._convolution", "aten.conv1d", "aten.conv2d", "aten.conv3d")),
    Rule("attention", "compute", ("aten.scaled_dot_product_attention",
                                  "aten._scaled_dot_product_flash_attention_for_cpu",
                                  "aten._scaled_dot_product_flash_attention",
                                  "aten._scaled_dot_product_efficient_attention",
                                  "aten._scaled_dot_product_cudnn_attention",
                                  "picofx.cp_gathered_attention", "picofx.cp_ring_attention")),
    # Fused ops run in the compute dtype; their kernels keep statistics and accumulation in fp32.
    # picofx.rope is not here: it follows its inputs, so fp32 RoPE tables keep it in fp32.
    Rule("fused", "compute", ("picofx.silu_mul", "picofx.linear_cross_entropy")),
    # Rounding the fp32 stream to bf16 before the norm moved float8's first loss 1.5e-4 off torchao's.
    Rule("fused_norms", "output", ("picofx.rms_norm", "picofx.add_rms_norm")),
    Rule("norm_statistics", "fp32", ("aten.pow", "aten.mean", "aten.sum", "aten.var", "aten.var_mean",
                                     "aten.std", "aten.std_mean", "aten.rsqrt", "aten.sqrt", "aten.reciprocal",
                                     "aten.native_layer_norm", "aten.native_group_norm",
                                     "aten.native_batch_norm", "aten._native_batch_norm_legit",
                                     "aten._native_batch_norm_legit_functional",
                                     "aten._native_batch_norm_legit_no_training", "aten.linalg_vector_norm",
                                     "aten.norm", "aten.cumsum", "aten.prod")),
    Rule("softmax", "fp32", ("aten._softmax", "aten.softmax", "aten._log_softmax", "aten.log_softmax",
                             "aten.logsumexp", "aten.exp", "aten.log", "aten.log1p", "aten.expm1")),
    Rule("rope_tables", "fp32", ("aten.cos", "aten.sin")),
    # Complex numbers exist in fp32 and fp64 only (complex RoPE: view_as_complex of q and k).
    Rule("complex", "fp32", ("aten.view_as_complex", "aten.complex", "aten.polar")),
    Rule("loss", "fp32", ("aten.nll_loss_forward", "aten.nll_loss2d_forward", "aten.cross_entropy_loss",
                          "aten.mse_loss", "aten.l1_loss", "aten.smooth_l1_loss", "aten.huber_loss",
                          "aten.binary_cross_entropy", "aten.binary_cross_entropy_with_logits",
                          "aten.kl_div")),
)
# Ops that need their floating tensor inputs in one dtype instead of promoting them: when the pass
# changes one input's dtype, all of them are cast to their promotion.
EQUAL_DTYPE_OPS = frozenset(("aten.index_put", "aten._unsafe_index_put", "aten.index_copy", "aten.index_add",
                             "aten.scatter", "aten.scatter_add", "aten.scatter_reduce", "aten.slice_scatter",
                             "aten.select_scatter", "aten.diagonal_scatter", "aten.as_strided_scatter",
                             "aten.masked_scatter", "aten.copy", "aten.lerp"))
USER_RULE = "fp32_ops"  # the rule of the ops a Precision(fp32_ops=...) adds


def parse_dtype(value, what: str = "dtype") -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in DTYPES:
        return DTYPES[value.lower()]
    raise ValueError(f"Precision: unknown {what} {value!r}; use one of {', '.join(DTYPES)} "
                     "(or torch.bfloat16 / torch.float16 / torch.float32).")


def op_name(target) -> str | None:
    """"namespace.op" of an ATen or custom op (overload or packet), None for anything else."""
    packet = getattr(target, "overloadpacket", target)
    qualified = getattr(packet, "_qualified_op_name", None)
    return qualified.replace("::", ".") if qualified else None


def resolve_op_names(ops) -> tuple[str, ...]:
    """Validate user-given ops ("aten.exp", "exp", torch.ops.aten.exp, torch.ops.aten.exp.default)."""
    names = []
    for op in ops:
        name = op_name(op) if not isinstance(op, str) else (op if "." in op else f"aten.{op}")
        namespace, _, short = (name or "").partition(".")
        if not name or not hasattr(getattr(torch.ops, namespace, None), short.split(".")[0]):
            raise ValueError(f"Precision: fp32_ops has {op!r}, which is not a registered op; name ops as "
                             "'aten.exp' (or torch.ops.aten.exp).")
        names.append(f"{namespace}.{short.split('.')[0]}")
    return tuple(names)


def rule_table(fp32_ops: tuple[str, ...]) -> dict[str, Rule]:
    """op name -> its rule; ops named in fp32_ops become fp32 islands whatever their default rule."""
    table = {op: rule for rule in RULES for op in rule.ops}
    user = Rule(USER_RULE, "fp32", fp32_ops)
    table.update({op: user for op in fp32_ops})
    return table


def explicitly_fp32(node: fx.Node) -> bool:
    """Some floating input of `node` is, through views, a cast from bf16/fp16 up to fp32 that the
    model made (the pass's own casts come later and are not in the captured graph it reads)."""
    for source in node.all_input_nodes:
        source = viewed_source(source, through_copies=True)
        if op_name(source.target) == "aten._to_copy" and source.kwargs.get("dtype") == torch.float32:
            val = source.args[0].meta.get("val") if isinstance(source.args[0], fx.Node) else None
            if isinstance(val, torch.Tensor) and val.dtype in LOW_PRECISION:
                return True
    return False


def weight_free_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that depend on no parameter: position tables, masks, index arithmetic. A matmul there
    (e.g. inverse frequencies times positions) is table arithmetic and stays in fp32."""
    free = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            slot = input_slot(node)
            if slot is None or slot.kind != "parameter":
                free.add(node)
        elif node.op == "call_function" and all(arg in free for arg in node.all_input_nodes):
            free.add(node)
    return free


def is_float_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()
