"""Why a capture failed, in the user's terms: the cause, where (the innermost frame of the
user's code and the module that ran), and what to do; also the checks capture makes before
exporting (does the model take labels?) and how an input is named in messages."""
from __future__ import annotations

import difflib
import inspect
import os
import traceback

import torch
import torch.utils._pytree as pytree
from torch import nn

from picofx.errors import CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)
_PICOFX_DIR = os.path.dirname(os.path.dirname(__file__))  # picofx/

# (words in the error, the cause in one sentence, what to do)
_CAUSES = [
    (("DynamicCache", "Cache", "past_key_values"),
     "the model returns a key/value cache object, which cannot be a graph output",
     "pass use_cache=False (in the call or the model's config) for training"),
    (("data-dependent", "data dependent", "GuardOnDataDependentSymNode", "Could not guard on", ".item()",
      "could not extract specialized integer", "DataDependentOutputException"),
     "Python control flow (an if, a loop bound or .item()) depends on a tensor's values",
     "move the branch out of the model, express it with torch.where or torch.cond, or register the "
     "function as a torch.library.custom_op with a fake implementation"),
    (("no fake", "fake impl", "Meta", "meta kernel", "UnsupportedOperatorException", "NotImplementedError"),
     "an operator has no fake (meta) implementation, so its output shape cannot be traced",
     "register the function as a torch.library.custom_op and give it a fake implementation"),
    (("not a registered pytree", "pytree", "unsupported type"),
     "an input or output is a Python object torch.export cannot flatten",
     "return tensors (or a registered output class) and pass tensors or constants"),
]


def explain_capture_failure(error: Exception, module_stack: list[str], model: nn.Module | None = None,
                            args: tuple = (), kwargs: dict | None = None) -> tuple[CaptureError, bool]:
    """The CaptureError for an export failure, and whether its cause is known (then torch's
    traceback adds nothing the message does not say)."""
    text = f"{type(error).__name__}: {error}"
    cause, hint = "torch.export could not trace the step", "see the torch error below; a model that " \
        "runs eagerly with static shapes and no data-dependent Python control flow captures"
    known = False
    for words, c, h in _CAUSES:
        if any(w in text for w in words):
            cause, hint, known = c, h, True
            break
    too_long = _over_position_limit(model, args, kwargs or {}) if model is not None else None
    if too_long:
        cause, hint, known = too_long
    where = _user_frame(error)
    module = f" in module '{module_stack[-1]}'" if module_stack and module_stack[-1] else ""
    at = f"\n  at {where}{module}" if where or module else ""
    first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    return CaptureError(f"cannot capture the model: {cause}.{at}\n  fix: {hint}.\n"
                        f"  torch said: {type(error).__name__}: {first_line}"), known


POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_seq_len", "block_size", "n_ctx")
CONFIG_ATTRIBUTES = ("config", "params", "args")  # where models keep their configuration


def position_limit(model: nn.Module) -> tuple[str, int] | None:
    """The model's longest sequence and the field that sets it: ("config.max_position_embeddings", 2048)."""
    for attribute in CONFIG_ATTRIBUTES:
        config = getattr(model, attribute, None)
        for name in POSITION_LIMITS:
            if isinstance(getattr(config, name, None), int) and not isinstance(getattr(config, name), bool):
                return f"{attribute}.{name}", getattr(config, name)
    return None


def _over_position_limit(model: nn.Module, args: tuple, kwargs: dict) -> tuple[str, str, bool] | None:
    """(cause, fix, True) when a (batch, sequence) integer input (token ids) is longer than the
    model's position limit."""
    limit = position_limit(model)
    if limit is None:
        return None
    for path, x in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point() and x.shape[-1] > limit[1]:
            name = argument_name(path)
            where, _, field = limit[0].partition(".")
            return (f"{name} has {x.shape[-1]} positions (shape {tuple(x.shape)}), more than the model's "
                    f"{field}={limit[1]} (in {type(model).__name__}.{where})",
                    f"use sequences of at most {limit[1]} tokens, or build the model with {field} >= "
                    f"{x.shape[-1]}", True)
    return None


def check_position_limit(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Token ids longer than the model's position limit are refused before anything is traced (a
    rotary model would otherwise accept them silently, past the positions it was built for)."""
    too_long = _over_position_limit(model, args, kwargs)
    if too_long:
        cause, fix, _ = too_long
        raise CaptureError(f"capture: {cause}; {fix}.") from None


def argument_name(path: tuple) -> str:
    """A pytree path into (args, kwargs) as the call wrote it: 'input_ids', 'argument 0', "batch['ids']"."""
    in_kwargs, top, rest = path[0].idx == 1, path[1], pytree.keystr(tuple(path[2:]))
    return f"{top.key}{rest}" if in_kwargs else f"argument {top.idx}{rest}"


def call_arguments(args: tuple, kwargs: dict) -> str:
    """A call's arguments by name: "argument 0, input_ids, labels"."""
    return ", ".join([f"argument {i}" for i in range(len(args))] + list(kwargs)) or "no arguments"


def accepts_labels(model: nn.Module) -> bool:
    """Whether the model's forward takes a `labels` argument (or any keyword)."""
    return not unknown_keywords(model, ["labels"])


def unknown_keywords(model: nn.Module, names) -> list[str]:
    """The names the model's forward has no parameter for (none if it takes **kwargs)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    return [name for name in names if name not in parameters]


def check_keywords(model: nn.Module, kwargs: dict) -> None:
    """A keyword the model's forward does not take is named before anything is traced."""
    unknown = unknown_keywords(model, kwargs)
    if unknown:
        known = list(inspect.signature(model.forward).parameters)
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise CaptureError(f"capture: {type(model).__name__}.forward takes no argument {unknown[0]!r} "
                           f"(it takes {', '.join(known)}){hint}")


def _user_frame(error: BaseException) -> str:
    """The innermost frame of the failure that is the user's code, not torch's or picofx's."""
    frames = []
    e: BaseException | None = error
    while e is not None:
        frames.extend(traceback.extract_tb(e.__traceback__))
        e = e.__cause__ or e.__context__
    user = [f for f in frames if not f.filename.startswith((_TORCH_DIR, _PICOFX_DIR, "<"))]
    if not user:
        return ""
    f = user[-1]
    return f"{f.filename}:{f.lineno} ({f.name}: {(f.line or '').strip()})"
