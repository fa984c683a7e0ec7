"""torchao's float8 training as the numerics reference for `Precision(float8=...)` (a test extra)."""
import copy

import pytest
import torch

torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao is the float8 reference (the test extra)")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

BF16 = torch.bfloat16


def torchao_model(model, recipe: str, exclude=()):
    """A copy of `model` with its linear layers converted by torchao (except the module paths in
    `exclude`), whose float8 layers take bf16 inputs under CPU autocast: torchao casts its input to
    the autocast dtype on CUDA only, and picofx's bf16 policy hands every linear bf16 inputs."""
    converted = torchao_float8.convert_to_float8_training(
        copy.deepcopy(model), config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda module, path: path not in exclude)
    for module in converted.modules():
        if isinstance(module, Float8Linear):
            module.register_forward_pre_hook(
                lambda _, args: (args[0].to(BF16),) if torch.is_autocast_enabled("cpu") else args)
    return converted


def autocast_step(z, model):
    """The zoo model's loss on a batch, under CPU autocast to bf16."""
    def step(batch):
        with torch.autocast("cpu", BF16):
            if z.loss_fn is None:
                return model(**batch).loss
            return z.loss_fn(model(batch["input_ids"]), batch["labels"])
    return step


def picofx_step(z, opt):
    return (lambda batch: opt(**batch)) if z.loss_fn is not None else (lambda batch: opt(**batch).loss)


def max_relative_error(model, reference) -> float:
    """max over parameters of ||grad - reference grad|| / ||reference grad||."""
    return max(((p.grad - r.grad).norm() / r.grad.norm()).item()
               for p, r in zip(model.parameters(), reference.parameters()))
