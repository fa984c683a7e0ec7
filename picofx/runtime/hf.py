"""What Hugging Face `Trainer` and `accelerate` read from a model, presented by the optimized module.

`Trainer` decides from the model's class and attributes how to treat it: the `forward` signature
of the class says which dataset columns to keep and which are labels; `isinstance(model,
PreTrainedModel)` chooses `save_pretrained` over a bare state dict; `config`, `main_input_name`,
`_keys_to_ignore_on_save`, `num_parameters`, `can_generate` and the checkpointing switches are
read or called. `optimized_class` builds, per optimized model, a subclass of the optimized module
that answers each of them like the model (a Hugging Face model's optimized module is an instance
of the model's own class), or fails with what to do instead. transformers is never imported here.
"""
from __future__ import annotations

import inspect

from torch import nn

from picofx.manager.passes import pass_name

RECOMPUTING_PASSES = ("checkpoint",)   # passes that plan activation recomputation themselves
GRADIENT_SYNCING_PASSES = ("overlap",)  # passes that all-reduce the gradients inside the backward graph


def call_signature(model: nn.Module, loss_fn) -> inspect.Signature:
    """The optimized module's call: the model's own; with `loss_fn`, also the `labels` keyword it
    passes to `loss_fn` instead of the model."""
    signature = inspect.signature(model.forward)
    params = list(signature.parameters.values())
    if loss_fn is None or "labels" in signature.parameters:
        return signature
    labels = inspect.Parameter("labels", inspect.Parameter.KEYWORD_ONLY)
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    return signature.replace(parameters=[*params[:at], labels, *params[at:]])


def is_pretrained_model(model: nn.Module) -> bool:
    """A transformers `PreTrainedModel`, recognised by its class's lineage (transformers stays optional)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def optimized_class(base: type, model: nn.Module, loss_fn, passes) -> type:
    """A subclass of `base` (the optimized module) for `model`: `forward` has the model's call
    signature, the Hugging Face surface below answers for the model, and a `PreTrainedModel`'s
    own class is a base too, so `isinstance(opt, type(model))` holds and the class attributes
    (`main_input_name`, `_no_split_modules`, `config_class`, ...) are the model's."""
    signature = call_signature(model, loss_fn)

    def forward(self, *args, **kwargs):
        if self.syncs_gradients:
            refuse_outer_ddp(self)
        return base.forward(self, *args, **kwargs)

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    forward.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])
    forward.__doc__ = f"The training step of {type(model).__name__}, optimized by picofx; called like the model."
    name = f"Optimized{type(model).__name__}"
    namespace = {"forward": forward, "__module__": __name__, "__qualname__": name,
                 "picofx_pass_names": tuple(pass_name(p) if not isinstance(p, str) else p for p in passes)}
    bases = (HuggingFaceSurface, base, type(model)) if is_pretrained_model(model) else (HuggingFaceSurface, base)
    return type(name, bases, namespace)


def refuse_outer_ddp(module: nn.Module) -> None:
    """A module that all-reduces its own gradients, called by DistributedDataParallel's forward,
    would have them all-reduced twice: say so instead."""
    from torch.nn.parallel import DistributedDataParallel

    active = DistributedDataParallel._get_active_ddp_module()  # set while DDP's forward runs its module
    if active is not None and active.module is module:
        raise RuntimeError("this optimized module all-reduces its gradients inside the backward (pass 'overlap'); "
                           "call it directly, not through DistributedDataParallel, which would all-reduce them "
                           "a second time (or optimize without 'overlap' and keep DDP).")


class HuggingFaceSurface:
    """The attributes `Trainer` and `accelerate` read, answered for the wrapped model. Mixed in
    before the optimized module; `self._model` is the model it wraps."""

    picofx_pass_names: tuple = ()

    # ---- what the model is ------------------------------------------------------------------
    @property
    def main_input_name(self) -> str:
        default = next(iter(inspect.signature(self.forward).parameters), "input_ids")
        return getattr(self._model, "main_input_name", default)

    @property
    def _keys_to_ignore_on_save(self):
        return getattr(self._model, "_keys_to_ignore_on_save", None)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        if hasattr(self._model, "num_parameters"):
            return self._model.num_parameters(only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
        embeddings = {id(m.weight) for m in self._model.modules() if isinstance(m, nn.Embedding)}
        return sum(p.numel() for p in self._model.parameters()
                   if (p.requires_grad or not only_trainable) and not (exclude_embeddings and id(p) in embeddings))

    # ---- saving: exactly what the plain model saves ----------------------------------------
    def save_pretrained(self, *args, **kwargs):
        """The model's own `save_pretrained` (config, weights under their original names)."""
        if not hasattr(self._model, "save_pretrained"):
            raise AttributeError(f"{type(self._model).__name__} has no save_pretrained; save opt.state_dict() "
                                 "(the model's own keys) with torch.save or safetensors.")
        return self._model.save_pretrained(*args, **kwargs)

    # ---- generation: not the training step's job --------------------------------------------
    @classmethod
    def can_generate(cls) -> bool:
        return False

    def generate(self, *args, **kwargs):
        raise NotImplementedError("an optimized module runs the captured training step; generate with the model "
                                  "you passed to picofx.optimize (it shares these parameters).")

    # ---- activation checkpointing: picofx's checkpoint pass, not torch.utils.checkpoint ------
    @property
    def supports_gradient_checkpointing(self) -> bool:
        return True

    @property
    def is_activation_checkpointing(self) -> bool:
        return any(name in RECOMPUTING_PASSES for name in self.picofx_pass_names)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.is_activation_checkpointing

    def activation_checkpointing_enable(self, *args, **kwargs) -> None:
        """Accepted when a checkpoint pass plans the step's recomputation; otherwise says how to ask for it."""
        if not self.is_activation_checkpointing:
            raise ValueError(
                "picofx plans activation checkpointing in the captured step: pass "
                "picofx.passes.Checkpoint(budget=...) to picofx.optimize (it picks what to recompute so the step "
                "fits the budget) instead of gradient_checkpointing=True / gradient_checkpointing_enable(), whose "
                "torch.utils.checkpoint regions the captured step does not run.")

    def gradient_checkpointing_enable(self, *args, **kwargs) -> None:
        self.activation_checkpointing_enable(*args, **kwargs)

    def activation_checkpointing_disable(self) -> None:
        if self.is_activation_checkpointing:
            raise ValueError("this module's recomputation is planned by picofx's checkpoint pass; optimize the "
                             "model again without it to turn it off.")

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    # ---- data parallel: who all-reduces the gradients ----------------------------------------
    @property
    def syncs_gradients(self) -> bool:
        """True when a pass all-reduces the gradients inside the backward graph (picofx's overlap)."""
        return any(name in GRADIENT_SYNCING_PASSES for name in self.picofx_pass_names)

    @property
    def _is_accelerate_prepared(self) -> bool:
        # accelerate wraps a model in DistributedDataParallel unless it says it is prepared already:
        # a module that all-reduces its own gradients must not be all-reduced a second time by DDP.
        return self.syncs_gradients or self.__dict__.get("accelerate_prepared", False)

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:  # accelerate marks what it prepared
        self.__dict__["accelerate_prepared"] = value
