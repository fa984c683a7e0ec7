"""Capture a training step's forward (loss included) as an ATen-level FX graph.

`capture` exports the model with `torch.export` (non-strict), lowers it to ATen while keeping
`linear` and `scaled_dot_product_attention` whole (pattern rules and the cost model read them),
and records how the graph's placeholders map back to the model: parameters and buffers by
their fully qualified names, so that the optimized model keeps using the model's own tensors.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind

from picofx.capture.vocabulary import INPUT_META, MODULE_PATH_META, SIGNATURE_META, input_slot
from picofx.errors import CaptureError
from picofx.capture.annotate import annotate
from picofx.capture.explain import (accepts_labels, argument_name, check_keywords, check_position_limit,
                                    explain_capture_failure)

KEPT_WHOLE = (torch.ops.aten.linear.default, torch.ops.aten.scaled_dot_product_attention.default)


@functools.cache
def aten_decompositions() -> dict:
    """The decompositions capture (and rule tracing) applies: torch.export's default table,
    with KEPT_WHOLE left whole; materialized once, not on every export."""
    table = torch.export.default_decompositions()
    for op in KEPT_WHOLE:
        del table[op]
    return table.materialize()


@dataclass(frozen=True)
class InputSlot:
    kind: str  # "parameter", "buffer", "constant" or "user"
    target: str  # the model's parameter/buffer name, the constant's name, or the user input's index

    def resident_value(self, module: nn.Module, constants: dict):
        """The value of a slot that is no user input: `module`'s own parameter or buffer, or the constant."""
        if self.kind == "parameter":
            return module.get_parameter(self.target)
        if self.kind == "buffer":
            return module.get_buffer(self.target)
        return constants[self.target]


@dataclass
class Signature:
    """How the graph's placeholders and outputs map onto the model and its call."""

    inputs: list[InputSlot]
    in_spec: pytree.TreeSpec  # of (args, kwargs) as the user passes them
    out_spec: pytree.TreeSpec  # of what the model (or loss_fn) returns
    outputs: list[tuple[str, str | None]]  # ("user", None) or ("buffer", fqn) per graph output
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    input_key: tuple = ()  # shapes/dtypes/values of the captured call; another key recaptures


class LossStep(nn.Module):
    """`loss_fn(model(*args, **kwargs), labels)`: the step for models that return logits."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args, labels, **kwargs):
        output = self.model(*args, **kwargs)
        try:
            return self.loss_fn(output, labels)
        except Exception as e:
            if isinstance(output, torch.Tensor) or not accepts_labels(self.model):
                raise
            raise CaptureError(f"loss_fn failed on the model's output, a {type(output).__name__}: "
                               f"{type(e).__name__}: {e}.\n  {type(self.model).__name__}.forward takes labels and "
                               "computes its own loss: drop loss_fn and pass labels to the model.") from None


def split_inputs(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def input_key(args: tuple, kwargs: dict) -> tuple:
    """What a captured graph is specialised on: tensor shapes and dtypes, other values as they are."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    key = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device.type))
        else:
            key.append(("value", repr(leaf)))
    return tuple(key)


def input_changes(args0: tuple, kwargs0: dict, args: tuple, kwargs: dict) -> str:
    """What differs between two calls, briefly: "input_ids (2, 32) -> (2, 16)"; "" if nothing does."""
    old, old_spec = pytree.tree_flatten_with_path((args0, kwargs0))
    new, new_spec = pytree.tree_flatten_with_path((args, kwargs))
    if old_spec != new_spec:
        return "other arguments"

    def shown(x):
        return f"{tuple(x.shape)}" + ("" if x.dtype in (torch.int64, torch.float32) else f" {x.dtype}") \
            if isinstance(x, torch.Tensor) else repr(x)

    return ", ".join(f"{argument_name(path)} {shown(a)} -> {shown(b)}" for (path, a), (_, b) in zip(old, new)
                     if shown(a) != shown(b))


def capture(model: nn.Module, example_inputs, loss_fn=None) -> fx.GraphModule:
    """The forward of one training step, loss included, as an annotated ATen GraphModule.

    `example_inputs` is a tuple of positional arguments or a dict of keyword arguments.
    A model that computes its own loss (Hugging Face models given `labels`) is captured as it is.
    A model that returns logits takes `loss_fn(output, labels)`: the inputs then carry a
    `labels` keyword, which is given to `loss_fn` instead of the model.
    """
    args, kwargs = split_inputs(example_inputs)
    return capture_call(model, args, kwargs, loss_fn)


def capture_call(model: nn.Module, args: tuple, kwargs: dict, loss_fn=None) -> fx.GraphModule:
    """`capture` for a call given as positional and keyword arguments."""
    step, prefix = (LossStep(model, loss_fn), "model.") if loss_fn is not None else (model, "")
    if loss_fn is not None and "labels" not in kwargs:
        raise CaptureError("capture: with loss_fn, example_inputs must be a dict (or kwargs) with a "
                           "'labels' entry; it is passed to loss_fn(output, labels) and not to the model.")
    if loss_fn is None and "labels" in kwargs and not accepts_labels(model):
        raise CaptureError(f"capture: {type(model).__name__}.forward takes no 'labels', so it returns its "
                           "output, not a loss: pass loss_fn=..., called as loss_fn(output, labels) (e.g. "
                           "picofx.models.llama.causal_lm_loss), or leave labels out to capture the forward alone.")
    model_kwargs = {k: v for k, v in kwargs.items() if loss_fn is None or k != "labels"}
    check_keywords(model, model_kwargs)
    check_position_limit(model, args, model_kwargs)
    with _module_path_tracker(model) as where, quiet_export(), without_kv_cache(model, model_kwargs):
        try:
            ep = torch.export.export(step, args, kwargs, strict=False)
            ep = ep.run_decompositions(aten_decompositions())
        except CaptureError:
            raise
        except Exception as e:  # explained; torch's traceback is chained when the cause is unknown
            error, known = explain_capture_failure(e, where, model, args, kwargs)
            error.torch_error = e
            raise error from (None if known else e)
    gm = ep.graph_module
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    signature = _signature(ep, prefix, args, kwargs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, slot in zip(placeholders, signature.inputs):
        node.meta[INPUT_META] = slot
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta[MODULE_PATH_META] = _strip(list(stack.values())[-1][0], prefix)
        elif node.op == "placeholder" and input_slot(node).kind in ("parameter", "buffer"):
            node.meta[MODULE_PATH_META] = input_slot(node).target.rpartition(".")[0]
    gm.meta[SIGNATURE_META] = signature
    gm.recompile()
    annotate(gm)
    return gm


def _strip(path: str, prefix: str) -> str:
    return path[len(prefix):] if prefix and path.startswith(prefix) else ("" if path + "." == prefix else path)


def _signature(ep, prefix: str, args: tuple, kwargs: dict) -> Signature:
    slots = []
    user_index = 0
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.PARAMETER:
            slots.append(InputSlot("parameter", _strip(spec.target, prefix)))
        elif spec.kind == InputKind.BUFFER:
            slots.append(InputSlot("buffer", _strip(spec.target, prefix)))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            slots.append(InputSlot("constant", spec.target))
        elif spec.kind == InputKind.USER_INPUT:
            slots.append(InputSlot("user", str(user_index)))
            user_index += 1
        else:
            raise CaptureError(f"capture: unsupported graph input {spec.arg} of kind {spec.kind.name}; "
                               "picofx handles parameters, buffers, constants and tensor inputs.")
    tensor_leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if user_index != len(tensor_leaves):
        raise CaptureError(f"capture: the graph takes {user_index} inputs but the call has "
                           f"{len(tensor_leaves)} tensors; pass non-tensor options as Python constants.")
    outputs = []
    for spec in ep.graph_signature.output_specs:
        if spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(("user", None))
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            outputs.append(("buffer", _strip(spec.target, prefix)))
        else:
            raise CaptureError(f"capture: the step {spec.kind.name.lower().replace('_', ' ')}s "
                               f"{spec.target}; picofx captures steps that mutate nothing but buffers.")
    constants = {name: value for name, value in ep.constants.items() if isinstance(value, torch.Tensor)}
    return Signature(slots, ep.call_spec.in_spec, ep.call_spec.out_spec, outputs, constants,
                     input_key(args, kwargs))


@contextlib.contextmanager
def _module_path_tracker(model: nn.Module):
    """Track which submodule is running, so a failure can name it."""
    stack: list[str] = []

    def leave(module, args, output):
        if stack:
            stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        handles.append(module.register_forward_hook(leave))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def without_kv_cache(model: nn.Module, kwargs: dict):
    """A Hugging Face model's config.use_cache (True by default: generation keeps a key/value cache
    object, which cannot be a graph output) set False while the training step is captured, and put
    back after; a use_cache the call passes itself is left to it."""
    config = getattr(model, "config", None)
    if "use_cache" in kwargs or not getattr(config, "use_cache", False):
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


@contextlib.contextmanager
def quiet_export():
    """torch.export's own chatter off the user's terminal while picofx captures: the LeafSpec
    deprecation its deep copies raise, and the fake-tensor log of a failure the CaptureError explains."""
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    was_disabled, fake_tensor_log.disabled = fake_tensor_log.disabled, True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            yield
    finally:
        fake_tensor_log.disabled = was_disabled
