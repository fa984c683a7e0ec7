"""Pass `precision`: each node of the forward graph computes in the dtype a policy gives it.

    Precision(dtype="bf16", overrides={"final_proj": "fp32"}, fp32_ops=("aten.tanh",),
              sensitivity=None, loss_scale=None)

Matmuls, attention and fused ops compute in `dtype` (the fused norms in fp32, writing their output
in `dtype`); norm statistics, softmax, RoPE tables and losses stay fp32 (the rules in rules.py);
everything else follows its inputs.
`overrides` maps module-path globs to a dtype for the matmul/attention/fused nodes of the
matching modules and their submodules (a later entry wins over an earlier one).
`float8` ("tensorwise", "rowwise", "rowwise_with_gw_hp": torchao's recipes) runs the linear layers
`float8_layers` selects ("auto": where the cost rule predicts a gain; "all"; module-path globs) in
float8 with dynamic scales, forward and backward (float8.py, float8_choice.py, float8_linear.py);
the notes' "float8_layers" give each linear layer's choice and why.
`sensitivity` measures, on the example inputs, each low-precision node's own relative error
against fp32 and keeps the nodes above it in fp32 (listed in the notes' "kept_fp32").

Master weights stay fp32: parameters are never converted; the graph casts each weight once per
step, the backward reuses that cast, and gradients arrive in fp32. Optimizer state is untouched.

fp16 needs loss scaling: pass the `torch.amp.GradScaler` the training loop steps with as
`loss_scale` (docs/passes/precision.md shows the loop); the pass checks it is enabled. bf16 needs none.
"""
from __future__ import annotations

import fnmatch
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import fx

from picofx.capture.vocabulary import module_path
from picofx.cost.device import device_for
from picofx.manager import PassInfo, PassResult, Stage, register_pass
from picofx.passes.precision.casts import insert_casts
from picofx.passes.precision.float8 import check_device, check_options, fused_loss_note, rewrite_to_float8
from picofx.passes.precision.float8_gather import gather_in_float8
from picofx.passes.precision.rules import (LOW_PRECISION, Rule, explicitly_fp32, is_float_tensor, op_name,
                                          parse_dtype, resolve_op_names, rule_table, weight_free_nodes)
from picofx.runtime.peaks import low_precision_cost

# (rtol, atol), norm-wise per tensor, against the fp32 graph on the example inputs: rounding the
# inputs of every matmul to 8 (bf16) or 11 (fp16) significant bits moves the loss in its 3rd (4th)
# digit and each gradient by about 1% (0.2%) of its norm; element-wise bounds cannot serve
# gradients whose entries span four orders of magnitude (Hugging Face Llama: 0.006 to 85).
# bf16 allows 5%: a gradient that nearly cancels (the k projection's bias: softmax ignores a shift
# shared by every key, so its terms sum to ~4e-4 against ~1e-2 for the weights) keeps the absolute
# rounding of its terms, measured at 3.9% of its norm on a one-layer Hugging Face Llama.
TOLERANCE = {torch.bfloat16: (5e-2, 1e-6), torch.float16: (5e-3, 1e-7), torch.float32: (1e-5, 1e-6)}
# Float8 linear layers: e5m2 gradients keep 2 significant bits; on the tiny LLaMA torchao's float8 and
# picofx's both move the worst gradient by ~12% of its norm from fp32 (the first loss by ~2e-4).
FLOAT8_TOLERANCE = (2.5e-1, 1e-6)


@register_pass("precision")
@dataclass(frozen=True)
class Precision:
    dtype: str | torch.dtype = "bf16"
    overrides: dict = field(default_factory=dict)  # module-path glob -> dtype
    fp32_ops: tuple = ()                            # ops kept in fp32 besides the default islands
    sensitivity: float | None = None                # relative error above which a node stays fp32
    loss_scale: object = None                       # the torch.amp.GradScaler the loop uses (fp16)
    float8: str | None = None                       # "tensorwise" | "rowwise" | "rowwise_with_gw_hp"
    float8_layers: str | tuple | list = "auto"      # "auto" | "all" | module-path globs
    info = PassInfo(Stage.FORWARD)

    def __post_init__(self):
        dtypes = {parse_dtype(self.dtype)} | {parse_dtype(d, f"dtype for override {g!r}")
                                              for g, d in self.overrides.items()}
        resolve_op_names(self.fp32_ops)
        check_options(self.float8, self.float8_layers)
        if self.sensitivity is not None and not self.sensitivity > 0:
            raise ValueError(f"Precision: sensitivity is a relative error threshold > 0, got {self.sensitivity!r}.")
        enabled = self.loss_scale is not None and _scaler_enabled(self.loss_scale)
        if torch.float16 in dtypes and not enabled:
            raise ValueError("Precision: fp16 without a way to scale the loss: fp16 gradients underflow "
                             "(and overflow) without it. Pass loss_scale=torch.amp.GradScaler(device) and "
                             "train with scaler.scale(loss).backward(); scaler.step(optimizer); "
                             "scaler.update() - or use dtype='bf16', which needs no scaling.")
        if torch.float16 not in dtypes and enabled:
            raise ValueError("Precision: loss_scale is given but no node computes in fp16; bf16 has fp32's "
                             "exponent range and needs no loss scaling. Drop loss_scale, or pass a "
                             "GradScaler(enabled=False) to keep one training loop for both dtypes.")

    def __call__(self, gm: fx.GraphModule, ctx) -> PassResult:
        compute = parse_dtype(self.dtype)
        overrides = {glob: parse_dtype(d) for glob, d in self.overrides.items()}
        check_globs(gm, overrides)
        if self.float8 is not None:
            check_device(ctx.device)
            if not isinstance(self.float8_layers, str):
                check_globs(gm, dict.fromkeys(self.float8_layers), what="float8_layers glob")
        table = rule_table(resolve_op_names(self.fp32_ops))
        plan, rules, matched = assign_dtypes(gm, compute, overrides, table)
        rounded_after = {n for n in plan if table[op_name(n.target)].kind == "output"}
        kept = {}
        if self.sensitivity is not None:
            low = {n: d for n, d in plan.items() if d in LOW_PRECISION}
            errors = measure_errors(gm, ctx.example_inputs, low, rounded_after)
            kept = {n: e for n, e in errors.items() if e > self.sensitivity}
            plan.update({n: torch.float32 for n in kept})
        changes = insert_casts(gm, plan, rounded_after)
        if self.float8 is not None:
            float8_notes = self.float8_rewrite(gm, ctx)
        planned = set(plan.values())
        loosest = next((d for d in (torch.bfloat16, torch.float16) if d in planned), torch.float32)
        if ctx.device.type == "cpu" and loosest != torch.float32:
            warn_if_slower_on_cpu(loosest)
        notes = {
            "dtype": str(compute).replace("torch.", ""),
            "low_precision_nodes": sum(d in LOW_PRECISION for d in plan.values()),
            "fp32_nodes": sum(d == torch.float32 for d in plan.values()),
            "weight_casts": changes["weight"], "activation_casts": changes["activation"],
            "output_casts": changes["output"], "loss_upcast": changes["loss_upcast"],
            "rounded_outputs": changes["rounded_outputs"],
            "rules": dict(rules), "overrides": dict(matched),
        }
        if self.sensitivity is not None:  # a line for the report's table, and every measured error
            notes["kept_fp32"] = ", ".join(f"{n.name} ({n.meta.get('module_path', '')}): {e:.3g}"
                                           for n, e in sorted(kept.items(), key=lambda kv: -kv[1])) or "none"
            notes["sensitivity_errors"] = {n.name: e for n, e in errors.items()}
        if self.float8 is not None:
            notes.update(float8_notes)
            changes["float8"] = float8_notes["float8_linears"]
        if self.loss_scale is not None and _scaler_enabled(self.loss_scale):
            notes["loss_scale"] = type(self.loss_scale).__name__  # the loop scales, steps and updates with it
        tolerance = FLOAT8_TOLERANCE if changes.get("float8") else TOLERANCE[loosest]
        return PassResult(changed=sum(changes.values()) > 0, notes=notes, tolerance=tolerance,
                          normwise=loosest != torch.float32 or bool(changes.get("float8")))

    def float8_rewrite(self, gm: fx.GraphModule, ctx) -> dict:
        device = getattr(ctx.cost_model, "device", None) or device_for(ctx.device)
        layers = self.float8_layers if isinstance(self.float8_layers, str) else tuple(self.float8_layers)
        choices = rewrite_to_float8(gm, self.float8, layers, device)
        notes = {"float8": self.float8, "float8_linears": sum(c.float8 for c in choices.values()),
                 "float8_layers": {layer: f"{'float8' if c.float8 else 'high precision'}: {c.reason}"
                                   for layer, c in choices.items()}}
        gathers = gather_in_float8(gm, self.float8)  # sequence parallelism's all-gathers, where they may
        if gathers:
            notes["float8_gathers"] = gathers
        fused = fused_loss_note(gm)
        if fused:
            notes["float8_fused_loss"] = fused
        return notes


class PrecisionCostWarning(UserWarning):
    """Low precision makes this machine's matmuls slower, not faster."""


# the dtypes this process has warned about (warnings' own "once" starts again at any filter change)
WARNED_CPU_COST: set = set()


def warn_if_slower_on_cpu(dtype: torch.dtype) -> None:
    """Warn, once per process, where `dtype` matmuls run slower than fp32 ones on this CPU, which
    then has no units for them; the rates are measured once per machine and kept in picofx's cache
    (picofx.runtime.peaks)."""
    if dtype in WARNED_CPU_COST:
        return
    fp32, low, when = low_precision_cost(dtype)
    if low >= fp32:
        return
    WARNED_CPU_COST.add(dtype)
    name = str(dtype).replace("torch.", "")
    warnings.warn(f"precision: {name} matmuls run at {low / 1e9:.3g} GFLOP/s on this CPU against {fp32 / 1e9:.3g} "
                  f"GFLOP/s in fp32 ({fp32 / low:.1f}x slower: it has no {name} matmul units; {when}), so the pass "
                  f"makes the step slower; it pays on GPUs and on CPUs with {name} units (AMX, AVX512-BF16): "
                  "leave it out here", PrecisionCostWarning)


def assign_dtypes(gm: fx.GraphModule, compute: torch.dtype, overrides: dict[str, torch.dtype],
                  table: dict[str, Rule]) -> tuple[dict, Counter, Counter]:
    """node -> the dtype it computes in, for the nodes a rule names; per-rule and per-override counts."""
    weight_free = weight_free_nodes(gm)
    plan, rules, matched = {}, Counter(), Counter()
    for node in gm.graph.nodes:
        rule = table.get(op_name(node.target)) if node.op == "call_function" else None
        if rule is None:
            continue
        if rule.kind == "fp32":
            plan[node] = torch.float32
        elif node in weight_free:  # table arithmetic (e.g. RoPE frequencies): as captured, fp32
            rules["rope_tables"] += 1
            continue
        elif explicitly_fp32(node):  # the model upcast its input itself: keep it as written
            rules["explicit_fp32"] += 1
            continue
        else:
            glob = override_for(module_path(node), overrides)
            plan[node] = overrides[glob] if glob is not None else compute
            if glob is not None:
                matched[glob] += 1
        rules[rule.name] += 1
    return plan, rules, matched


def matches(path: str, glob: str) -> bool:
    """A module's glob matches the module and its submodules ("final_proj" matches "final_proj.lora")."""
    return fnmatch.fnmatchcase(path, glob) or fnmatch.fnmatchcase(path, glob + ".*")


def override_for(path: str, overrides: dict) -> str | None:
    hits = [glob for glob in overrides if matches(path, glob)]
    return hits[-1] if hits else None


def check_globs(gm: fx.GraphModule, overrides: dict, what: str = "override") -> None:
    paths = sorted({module_path(n) for n in gm.graph.nodes} - {""})
    unmatched = [glob for glob in overrides if not any(matches(p, glob) for p in paths)]
    if unmatched:
        examples = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
        raise ValueError(f"Precision: {what} {unmatched[0]!r} matches no module of the graph; module "
                         f"paths look like: {examples}. Globs use fnmatch ('decoder_layers.0.*').")


def measure_errors(gm: fx.GraphModule, example_inputs: list, candidates: dict, rounded_after=frozenset()) -> dict:
    """Each candidate node's own error: its fp32 inputs (from an fp32 run on the example inputs),
    rounded to its planned dtype and computed in it (for a node in `rounded_after`: computed from
    them as they are, its output written in that dtype), against its fp32 output."""
    if example_inputs is None:
        raise ValueError("Precision(sensitivity=...) measures on the example inputs; the context has none.")
    probe = _ErrorProbe(gm, candidates, rounded_after)
    with torch.no_grad():
        probe.run(*example_inputs)
    return probe.errors


class _ErrorProbe(fx.Interpreter):
    def __init__(self, gm, candidates, rounded_after):
        super().__init__(gm)
        self.candidates, self.rounded_after, self.errors = candidates, rounded_after, {}

    def run_node(self, node: fx.Node):
        result = super().run_node(node)
        dtype = self.candidates.get(node)
        if dtype is not None and node in self.rounded_after:
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            self.errors[node] = relative_error(node.target(*args, **{**kwargs, "out_dtype": dtype}), result)
        elif dtype is not None:
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(dtype) if is_float_tensor(t) and t.dtype != torch.float64 else t,
                (args, kwargs))
            self.errors[node] = relative_error(node.target(*args, **kwargs), result)
        return result


def relative_error(approx, exact) -> float:
    """The largest, over the floating outputs, of ||approx - exact|| / ||exact||."""
    worst = 0.0
    for a, e in zip(pytree.tree_leaves(approx), pytree.tree_leaves(exact)):
        if is_float_tensor(e) and e.numel():
            diff = torch.linalg.vector_norm(a.double() - e.double())
            worst = max(worst, (diff / torch.linalg.vector_norm(e.double()).clamp_min(1e-30)).item())
    return worst if worst == worst else float("inf")  # nan (inf - inf) counts as unbounded


def _scaler_enabled(scaler) -> bool:
    if not all(callable(getattr(scaler, m, None)) for m in ("scale", "step", "update")):
        raise TypeError(f"Precision: loss_scale must be a torch.amp.GradScaler (an object with scale(), "
                        f"step() and update()), got {type(scaler).__name__}.")
    return scaler.is_enabled() if hasattr(scaler, "is_enabled") else True

