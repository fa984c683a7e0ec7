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

from picofx.manager.passes import PassInfo, pass_info

DATA_PARALLEL_DIMS = frozenset({"dp_replicate", "dp_shard"})  # a pass over these averages the gradients


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
    (`main_input_name`, `_no_split_modules`, `config_class`, ...) are the model's. `passes`: resolved;
    the surface answers from what each declares (its PassInfo), never from its name."""
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
                 "picofx_pass_infos": tuple(pass_info(p) for p in passes)}
    bases = (HuggingFaceSurface, base, type(model)) if is_pretrained_model(model) else (HuggingFaceSurface, base)
    return type(name, bases, namespace)


def refuse_outer_ddp(module: nn.Module) -> None:
    """A module that all-reduces its own gradients, called by DistributedDataParallel's forward,
    would have them all-reduced twice: say so instead."""
    from torch.nn.parallel import DistributedDataParallel

    active = DistributedDataParallel._get_active_ddp_module()  # set while DDP's forward runs its module
    if active is not None and active.module is module:
        raise RuntimeError("this optimized module averages its gradients over the ranks inside the backward "
                           "(pass 'overlap' or 'shard'); call it directly, not through DistributedDataParallel, "
                           "which would all-reduce them a second time (or optimize without them and keep DDP).")


def whole_state_dict(state: dict) -> dict:
    """`state` with each DTensor gathered into a whole tensor (a collective: every rank calls it,
    in the same key order); tensors shared by several keys stay shared."""
    from torch.distributed.tensor import DTensor

    gathered: dict = {}
    out = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            if id(value) not in gathered:
                gathered[id(value)] = value.full_tensor().detach()
            value = gathered[id(value)]
        out[key] = value
    return out


class HuggingFaceSurface:
    """The attributes `Trainer` and `accelerate` read, answered for the wrapped model. Mixed in
    before the optimized module; `self._model` is the model it wraps."""

    picofx_pass_infos: tuple[PassInfo, ...] = ()

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
    def save_pretrained(self, *args, state_dict=None, is_main_process: bool = True, **kwargs):
        """The model's own `save_pretrained` (config, weights under their original names). A sharded
        model (pass shard) is saved whole: every rank must call it (as Trainer does for a model
        that says `is_distributed_loading_by_transformers`); the shards are gathered, and the rank
        with `is_main_process` (rank 0) writes what the plain model's `from_pretrained` loads."""
        if not hasattr(self._model, "save_pretrained"):
            raise AttributeError(f"{type(self._model).__name__} has no save_pretrained; save opt.state_dict() "
                                 "(the model's own keys) with torch.save or safetensors.")
        if not self.is_distributed_loading_by_transformers:
            return self._model.save_pretrained(*args, state_dict=state_dict, is_main_process=is_main_process, **kwargs)
        import torch.distributed as dist

        whole = whole_state_dict(self._model.state_dict() if state_dict is None else state_dict)
        main = is_main_process and (not dist.is_initialized() or dist.get_rank() == 0)
        try:
            if main:
                self._model.save_pretrained(*args, state_dict=whole, is_main_process=True, **kwargs)
        finally:
            if dist.is_initialized():
                dist.barrier()  # the others wait until the files are written

    # ---- sharded parameters: Trainer leaves placement and gradient reduction to the model ----
    @property
    def is_distributed_loading_by_transformers(self) -> bool:
        """True when the parameters are DTensors (placed by shard or tensor_parallel when the step was
        built): Trainer then wraps the module in neither DDP nor FSDP, and calls `save_pretrained` on
        every rank (so the pieces can be gathered). Trainer asks for `save_only_model=True` then: the
        optimizer's sharded state is not saved in its checkpoints."""
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) for p in self._model.parameters())

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
        return any(info.plans_partition for info in self.picofx_pass_infos)  # it plans what the backward saves

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
        """True when a pass works over a data-parallel dimension: it averages the gradients itself
        (inside the backward graph, or for Shard's stages 1 and 2 right after it)."""
        return any(DATA_PARALLEL_DIMS & set(info.mesh_dims) for info in self.picofx_pass_infos)

    @property
    def _is_accelerate_prepared(self) -> bool:
        # accelerate wraps a model in DistributedDataParallel unless it says it is prepared already:
        # a module that all-reduces its own gradients must not be all-reduced a second time by DDP.
        return self.syncs_gradients or self.__dict__.get("accelerate_prepared", False)

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:  # accelerate marks what it prepared
        self.__dict__["accelerate_prepared"] = value
