"""What one decoder layer and the rest of the model cost for one sequence, read from the cost model.

The planner never captures the whole model: it predicts (`picofx.planner.predict.predict`, fake tensors, the
passes fuse + precision) the step of the model with one decoder layer and with two, one sequence
each, and takes the difference as a layer and the rest as the embedding, final norm, head and loss.
Everything then scales: time and activations with the tokens of a micro-batch, compute with 1/tp.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from picofx.planner import predict as plan
from picofx.cost.model import CostModel, is_alias
from picofx.models.llama import Llama, LlamaConfig, causal_lm_loss
from picofx.planner.models import parameter_count, with_layers

PASSES = ("fuse", "precision")


@dataclass(frozen=True)
class ModelCosts:
    """Per sequence of `seq` tokens: a decoder layer's and the rest's predicted forward and
    backward seconds and the activation bytes the backward keeps; parameters; FLOPs per token."""

    config: LlamaConfig
    seq: int
    layer_forward_s: float
    layer_backward_s: float
    layer_saved: int          # bytes a layer's forward keeps for its backward
    rest_forward_s: float     # embedding, final norm, head and loss
    rest_backward_s: float
    rest_saved: int
    transient: int            # the most the step allocates beyond what is kept (one layer's scratch, the loss)
    parameters: int
    flops_per_token: float    # the model's, forward and backward (6N + 12 L h T, as PaLM counts)
    layer_ops: int = 0        # ops a layer runs, forward and backward: each costs the device's op overhead
    rest_ops: int = 0         # once per call, whatever the batch (the times above leave it out)
    layer_tensors: int = 0    # parameter tensors of a layer: each costs the optimizer's per-tensor overhead
    rest_tensors: int = 0

    @property
    def layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def layer_parameters(self) -> int:
        return (self.parameters - self.embedding_parameters) // self.layers

    @property
    def embedding_parameters(self) -> int:
        return 2 * self.config.vocab_size * self.config.hidden_size + self.config.hidden_size


def count_ops(gm) -> int:
    """The ops of a graph that dispatch work (views and other aliases left out)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and not is_alias(n))


def _step(config: LlamaConfig, layers: int, seq: int, cost_model: CostModel, passes):
    """The predicted step of `config` with `layers` layers on one sequence: its forward and backward
    seconds without the per-op overhead, its op count and its parameter tensors."""
    with plan.fake_mode():
        model = Llama(with_layers(config, layers, seq))
        ids = torch.zeros(1, seq, dtype=torch.long)
    step = plan.predict(model, {"input_ids": ids, "labels": ids}, loss_fn=causal_lm_loss, passes=passes,
                        cost_model=cost_model)
    overhead = cost_model.device.op_overhead
    fw_ops, bw_ops = count_ops(step.forward), count_ops(step.backward)
    return (step, cost_model.graph_time(step.forward) - fw_ops * overhead,
            cost_model.graph_time(step.backward) - bw_ops * overhead, fw_ops + bw_ops,
            len(list(model.parameters())))


def model_costs(config: LlamaConfig, seq: int, cost_model: CostModel, passes=PASSES) -> ModelCosts:
    one, fw1, bw1, ops1, tensors1 = _step(config, 1, seq, cost_model, passes)
    two, fw2, bw2, ops2, tensors2 = _step(config, 2, seq, cost_model, passes)
    layer_saved = two.memory.saved_activations - one.memory.saved_activations
    transient = max(one.memory.forward_peak, one.memory.backward_peak - one.memory.gradients) \
        - one.memory.saved_activations
    params = parameter_count(config)
    h, layers = config.hidden_size, config.num_hidden_layers
    matmul_params = params - config.vocab_size * h  # the embedding lookup does no matmul
    return ModelCosts(config, seq, fw2 - fw1, bw2 - bw1, layer_saved, 2 * fw1 - fw2, 2 * bw1 - bw2,
                      max(0, 2 * one.memory.saved_activations - two.memory.saved_activations), max(transient, 0),
                      params, 6 * matmul_params + 12 * layers * h * seq, ops2 - ops1, 2 * ops1 - ops2,
                      tensors2 - tensors1, 2 * tensors1 - tensors2)
