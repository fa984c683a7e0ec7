"""What one decoder layer and the rest of the model cost for one sequence, read from the cost model.

The planner never captures the whole model: it predicts (`picofx.planner.predict.predict`, fake tensors, the
passes fuse + precision) the step of the model with one decoder layer and with two, one sequence
each, and takes the difference as a layer and the rest as the embedding, final norm, head and loss.
What a call costs whatever its batch (the weights' casts and concatenations: `*_call_*_s`) is
what the forward runs off the tokens' path; the backward's (the gradients' casts) is taken to be
the same. Everything then scales: time and activations with the
tokens of a micro-batch, compute with 1/tp.

Checkpointing (`recompute_s`, `saved_bytes`): full keeps each layer's input and runs its forward
again; selective keeps what the matmuls and attention produce and runs the rest of the forward
again (norms, rotary embedding, activation, casts: memory-bound kernels), as torchtitan's op-level
selective checkpointing and Megatron's selective recomputation keep the expensive outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from picofx.capture.annotate import tensor_bytes
from picofx.planner import predict as plan
from picofx.cost.model import CostModel, is_alias, kernel_of, node_flops
from picofx.models.llama import Llama, LlamaConfig, causal_lm_loss
from picofx.planner.models import parameter_count, tied, with_layers
from picofx.planner.store import CaptureStore

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
    layer_call_forward_s: float = 0.0   # per call, whatever its batch: the weights' casts and concatenations
    layer_call_backward_s: float = 0.0
    rest_call_forward_s: float = 0.0
    rest_call_backward_s: float = 0.0
    layer_cheap_forward_s: float = 0.0  # of layer_forward_s, the memory-bound kernels (selective recomputes them)
    layer_cheap_saved: int = 0          # of layer_saved, what those kernels produce
    layer_matmul_forward_s: float = 0.0  # of layer_forward_s, the matmuls'
    precision: str = "bf16"  # the layer's linears' (picofx.planner.float8.with_float8 makes the others)
    layer_float8_parameters: int = 0  # of layer_parameters, the weights of the linears that run in float8
    layer_float8_weights: int = 0     # how many weights those are

    def recompute_s(self, checkpoint) -> float:
        """Seconds per sequence a layer's backward runs again of its forward under `checkpoint`
        ("none", "selective", "full"; True is full)."""
        mode = _mode(checkpoint)
        return {"none": 0.0, "selective": self.layer_cheap_forward_s, "full": self.layer_forward_s}[mode]

    def saved_bytes(self, checkpoint) -> int:
        """Bytes per sequence a layer keeps for its backward under `checkpoint`."""
        mode = _mode(checkpoint)
        layer_input = self.seq * self.config.hidden_size * 2  # bf16
        return {"none": self.layer_saved, "selective": max(self.layer_saved - self.layer_cheap_saved, layer_input),
                "full": layer_input}[mode]

    @property
    def layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def layer_parameters(self) -> int:
        return (self.parameters - self.embedding_parameters) // self.layers

    @property
    def embedding_parameters(self) -> int:
        return (1 if tied(self.config) else 2) * self.config.vocab_size * self.config.hidden_size + \
            self.config.hidden_size  # the embedding, the head (unless tied to it), the final norm


def _mode(checkpoint) -> str:
    if isinstance(checkpoint, bool):
        return "full" if checkpoint else "none"
    return str(getattr(checkpoint, "value", checkpoint)).lower()


def count_ops(gm) -> int:
    """The ops of a graph that dispatch work (views and other aliases left out)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and not is_alias(n))


@dataclass(frozen=True)
class Captured:
    """A captured step, all a device needs to time it: its kernels, forward and backward."""

    forward: tuple        # picofx.cost.model.Kernel per op that dispatches work
    backward: tuple
    cheap: tuple          # the forward's memory-bound kernels on the tokens' path (selective recomputes them)
    per_call: tuple       # the forward's kernels off the tokens' path (the weights' casts)
    matmuls: tuple        # the forward's matmuls on the tokens' path
    tensors: int          # parameter tensors
    saved: int            # saved activations on the tokens' path, bytes (the weights' casts the backward
                          # reads are the weights, counted with them)
    cheap_saved: int      # of those, what the cheap kernels produce
    memory: object        # picofx.cost.model.StepMemory

    @property
    def ops(self) -> int:
        return len(self.forward) + len(self.backward)

    def seconds(self, device, kernels) -> float:
        return sum(k.seconds(device) for k in kernels)


def _token_path(gm) -> set:
    """The forward's nodes that depend on the token ids (integer inputs): the rest is per call."""
    seen = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and not val.is_floating_point():
            seen.add(node)
        elif any(arg in seen for arg in node.all_input_nodes):
            seen.add(node)
    return seen


def _producer(node):
    while node.op == "call_function" and is_alias(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _works(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and not is_alias(n)]


CAPTURED: dict = {}  # captured steps by what they depend on (not the device): timing on another needs no capture


def capture(config: LlamaConfig, layers: int, seq: int, cost_model: CostModel, passes, batch: int = 1,
            store: CaptureStore | None = None, say=None) -> Captured:
    """The step of `config` with `layers` layers on `batch` sequences, captured on fake tensors (or
    read from `store`, and kept there). `say(text)` hears of a capture before it starts."""
    key = (repr(config), layers, seq, batch, tuple(map(str, passes)), cost_model.fuses_pointwise,
           cost_model.backward_frees_inputs, cost_model.holds_outputs, cost_model.scratch.keywords.get("attention"))
    if key in CAPTURED:
        return CAPTURED[key]
    stored = store and store.load(key)
    if stored:
        CAPTURED[key] = stored
        return stored
    if say:
        say(f"capturing the step with {layers} decoder layer{'s' if layers > 1 else ''} on fake tensors "
            f"({seq:,} tokens)")
    with plan.fake_mode():
        model = Llama(with_layers(config, layers, seq))
        ids = torch.zeros(batch, seq, dtype=torch.long)
    step = plan.predict(model, {"input_ids": ids, "labels": ids}, loss_fn=causal_lm_loss, passes=passes,
                        cost_model=cost_model)
    on_path = _token_path(step.forward)
    tokens = [n for n in _works(step.forward) if n in on_path]
    cheap = [n for n in tokens if not node_flops(n)]
    per_call = [kernel_of(n) for n in _works(step.forward) if n not in set(tokens)]
    matmuls = [kernel_of(n) for n in tokens if node_flops(n)]
    taken = {n.name for n in step.backward.graph.nodes if n.op == "placeholder"}
    saved = {_producer(a) for a in step.forward.graph.output_node().all_input_nodes if a.name in taken}
    captured = Captured(tuple(map(kernel_of, _works(step.forward))), tuple(map(kernel_of, _works(step.backward))),
                        tuple(map(kernel_of, cheap)), tuple(per_call), tuple(k for k in matmuls if not k.attention),
                        len(list(model.parameters())),
                        sum(tensor_bytes(n.meta.get("val")) for n in saved if n in on_path),
                        sum(tensor_bytes(n.meta.get("val")) for n in saved if n in set(cheap)), step.memory)
    CAPTURED[key] = captured
    if store:
        store.save(key, captured)
    return captured


def model_costs(config: LlamaConfig, seq: int, cost_model: CostModel, passes=PASSES, say=None) -> ModelCosts:
    """`say(text)`, where given, hears of each capture before it starts (they are most of a plan's time)."""
    store = CaptureStore.from_environment()
    one, two = (capture(config, layers, seq, cost_model, passes, store=store, say=say) for layers in (1, 2))
    device = cost_model.device
    time = [{part: step.seconds(device, getattr(step, part))
             for part in ("forward", "backward", "cheap", "per_call", "matmuls")} for step in (one, two)]
    layer = {part: time[1][part] - time[0][part] for part in time[0]}
    rest = {part: 2 * time[0][part] - time[1][part] for part in time[0]}
    params = parameter_count(config)
    h, layers = config.hidden_size, config.num_hidden_layers
    memory = one.memory
    transient = max(memory.forward_peak, memory.backward_peak - memory.gradients) - memory.saved_activations
    # the embedding lookup does no matmul; the head does, tied to it or not
    matmul_params = params - (0 if tied(config) else config.vocab_size * h)
    return ModelCosts(config, seq, layer["forward"] - layer["per_call"], layer["backward"] - layer["per_call"],
                      two.saved - one.saved, rest["forward"] - rest["per_call"],
                      max(0.0, rest["backward"] - rest["per_call"]),
                      max(0, 2 * one.saved - two.saved), max(transient, 0),
                      params, 6 * matmul_params + 12 * layers * h * seq, two.ops - one.ops, 2 * one.ops - two.ops,
                      two.tensors - one.tensors, 2 * one.tensors - two.tensors, layer["per_call"], layer["per_call"],
                      rest["per_call"], rest["per_call"], layer["cheap"], two.cheap_saved - one.cheap_saved,
                      layer["matmuls"])
