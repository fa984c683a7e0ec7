"""The cost model every pass reads: time per node and the memory of a training step.

Time: a node takes max(FLOPs / the FLOP/s its kind of kernel reaches, bytes it reads and writes /
the bandwidth memory-bound kernels reach) + the device's per-op overhead; views and other aliases
take no time. A matmul's rate depends on its smallest dimension, attention's on the direction and
the causal mask (`picofx.cost.gpus`; the nominal CPU entry and calibrated devices: the peaks).

Memory: a step holds its parameters, buffers and inputs (resident), plus optimizer state when
one is named. On top of that the forward graph's live storages grow and shrink until it returns
the loss and the saved activations (its outputs beyond the user outputs); the backward graph
starts from those, frees each after its last use and produces the gradients, which stay.
The step's peak is resident + optimizer state + the larger of the two graphs' peaks, each
from `picofx.cost.liveness` (exact storage liveness over the execution order, views resolved; the
scratch memory of custom ops and attention kernels from `picofx.cost.inductor.workspace`). Under Inductor the
order, the buffers and their reuse are those of its generated code, with Inductor's config as it
is when asked (`picofx.cost.inductor.model.InductorMemoryModel`).
`picofx.memory.measure_peak` measures the same quantity.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import fx

from picofx.capture.annotate import tensor_bytes
from picofx.capture.vocabulary import module_path, traced_module_path
from picofx.cost.units import format_bytes
from picofx.cost.device import Device, device_for
from picofx.cost.inductor.model import memory_model_for
from picofx.cost.liveness import FreshFacts, Schedule, Timeline, schedule_of, storage_key, tensor_values
from picofx.cost.inductor.workspace import workspace_bytes

# A matmul's backward is two matmuls of its size; a pointwise backward reads and writes about twice.
BACKWARD_PER_FORWARD = 2.0


def is_alias(node: fx.Node) -> bool:
    """True when every tensor the node returns shares its storage with one of its inputs (a view,
    a detach, an in-place op, a getitem of a multi-output op)."""
    outs = tensor_values(node.meta.get("val"))
    if not outs:
        return True
    inputs = {storage_key(t) for arg in node.all_input_nodes for t in tensor_values(arg.meta.get("val"))}
    return all(storage_key(t) in inputs for t in outs)


def node_flops(node: fx.Node) -> int:
    return node.meta.get("flops", 0) or 0


def bytes_moved(node: fx.Node) -> int:
    """Bytes a node reads (its tensor inputs) and writes (its outputs); 0 for aliases."""
    if node.op != "call_function" or is_alias(node):
        return 0
    read = sum(tensor_bytes(arg.meta.get("val")) for arg in dict.fromkeys(node.all_input_nodes))
    return read + tensor_bytes(node.meta.get("val"))


def compute_dtype(node: fx.Node) -> torch.dtype:
    for arg in node.all_input_nodes:
        for t in tensor_values(arg.meta.get("val")):
            if t.is_floating_point():
                return t.dtype
    return torch.float32


def is_attention(node: fx.Node) -> bool:
    return "scaled_dot_product" in str(node.target) or "attention" in str(node.target)


def is_causal(node: fx.Node) -> bool:
    """The attention node's causal flag: a keyword, or the one True among its arguments (the other
    flags of the aten attention kernels are False in training)."""
    if "is_causal" in node.kwargs:
        return bool(node.kwargs["is_causal"])
    return any(arg is True for arg in node.args)


def smallest_matmul_dim(node: fx.Node) -> int:
    """The smallest of the last two dimensions of the node's floating-point inputs (M, N or K of a GEMM)."""
    dims = [d for arg in node.all_input_nodes for t in tensor_values(arg.meta.get("val"))
            if t.is_floating_point() and t.dim() >= 2 for d in t.shape[-2:]]
    return int(min(dims)) if dims else 1


def compute_rate(device: Device, node: fx.Node) -> float:
    """FLOP/s the node's kernel reaches on `device`: attention's or a matmul's."""
    return kernel_of(node).rate(device)


@dataclass(frozen=True)
class Kernel:
    """What times a node on any device: its FLOPs, the bytes it moves and the kind of its kernel."""

    flops: int
    moved: int
    dtype: torch.dtype
    attention: bool = False
    backward: bool = False
    causal: bool = False
    smallest_dim: int = 1

    def rate(self, device: Device) -> float:
        if self.attention:
            return device.attention_rate(self.dtype, self.backward, self.causal)
        return device.matmul_rate(self.dtype, self.smallest_dim)

    def seconds(self, device: Device) -> float:
        """Compute- or memory-bound, whichever is slower; without the per-op overhead."""
        compute = self.flops / self.rate(device) if self.flops else 0.0
        return max(compute, self.moved / device.pointwise_bandwidth())


def kernel_of(node: fx.Node) -> Kernel:
    flops, attention = node_flops(node), is_attention(node)
    backward = attention and "backward" in str(node.target)
    return Kernel(flops, bytes_moved(node), compute_dtype(node), attention, backward,
                  attention and is_causal(node), 1 if attention or not flops else smallest_matmul_dim(node))


@dataclass
class StepMemory:
    """Predicted memory of one training step, in bytes. `forward_peak` and `backward_peak` are
    above the resident bytes; the backward's includes the saved activations and the gradients."""

    parameters: int
    other_resident: int  # buffers, the step's inputs
    optimizer_state: int
    saved_activations: int
    gradients: int
    forward_peak: int
    backward_peak: int
    forward_peak_at: str = ""
    backward_peak_at: str = ""

    @property
    def resident(self) -> int:
        return self.parameters + self.other_resident + self.optimizer_state

    @property
    def peak(self) -> int:
        return self.resident + max(self.forward_peak, self.backward_peak)

    @property
    def peak_phase(self) -> str:
        return "forward" if self.forward_peak >= self.backward_peak else "backward"

    def table(self) -> str:
        rows = [("parameters", self.parameters), ("buffers and inputs", self.other_resident),
                ("optimizer state", self.optimizer_state), ("saved activations", self.saved_activations),
                ("gradients", self.gradients),
                (f"forward peak (at {self.forward_peak_at})", self.forward_peak),
                (f"backward peak (at {self.backward_peak_at})", self.backward_peak),
                (f"step peak ({self.peak_phase})", self.peak)]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name.ljust(width)}  {format_bytes(value):>11}" for name, value in rows)


class CostModel:
    """Predictions for one device. `backward_frees_inputs`: the backward graph drops each saved
    activation after its last use (boxed calling convention, as Inductor and picofx's eager
    runtime do); False keeps them all until the backward returns. `holds_outputs`: the caller
    keeps the step's outputs (logits beside the loss) alive through the backward, as
    `out = model(...); out.loss.backward()` does; by default only what the backward takes lives
    on, as with `model(...).loss.backward()` or a loss_fn that returns the loss alone.
    `fuses_pointwise`: the graphs run compiled by Inductor, with its fused kernels, kernel order
    and buffer reuse (`picofx.cost.inductor.model.InductorMemoryModel`); False counts every value
    in graph order (eager).
    `attention_scratch`: count the scratch memory of attention kernels, which on the CPU depends
    on the thread count and is not a polynomial in batch and sequence (`picofx.cost.symbolic` turns
    it off)."""

    def __init__(self, device: Device | torch.device | str | None = None, *, backward_frees_inputs: bool = True,
                 holds_outputs: bool = False, fuses_pointwise: bool = False, attention_scratch: bool = True):
        if device is None or isinstance(device, (torch.device, str)):
            device = device_for(device or "cpu")
        self.device = device
        self.backward_frees_inputs = backward_frees_inputs
        self.holds_outputs = holds_outputs
        self.memory = memory_model_for("inductor" if fuses_pointwise else "eager")
        self.scratch = partial(workspace_bytes, attention=attention_scratch)

    @classmethod
    def for_backend(cls, device, backend: str) -> CostModel:
        """The default model for graphs that `backend` ("eager" or "inductor") runs on `device`."""
        return cls(device, fuses_pointwise=memory_model_for(backend).fuses_pointwise)

    @property
    def fuses_pointwise(self) -> bool:
        return self.memory.fuses_pointwise

    def node_time(self, node: fx.Node) -> float:
        """Seconds: the node is bound by compute or by memory traffic, whichever is slower."""
        if node.op != "call_function" or is_alias(node):
            return 0.0
        return kernel_of(node).seconds(self.device) + self.device.op_overhead

    def training_time(self, node: fx.Node, needs_grad: set) -> float:
        """Seconds of a forward node and, where its output is in `needs_grad` (it carries a
        gradient), its backward: BACKWARD_PER_FORWARD x the forward's time."""
        return self.node_time(node) * (1 + (BACKWARD_PER_FORWARD if node in needs_grad else 0))

    def graph_time(self, gm: fx.GraphModule) -> float:
        return sum(self.node_time(n) for n in gm.graph.nodes)

    def graph_flops(self, gm: fx.GraphModule) -> int:
        return sum(node_flops(n) for n in gm.graph.nodes if n.op == "call_function")

    def step_memory(self, forward: fx.GraphModule | Schedule, backward: fx.GraphModule | Schedule,
                    optimizer_state: int = 0, timelines: tuple[Timeline, Timeline] | None = None,
                    facts=None) -> StepMemory:
        """The step's memory from its partitioned graphs, or from their predicted schedules
        (and their `timelines`, where the caller has them already). `facts`: the
        `picofx.cost.liveness.NodeFacts` of a caller that simulates one graph many times."""
        fw_s, bw_s = _schedule(forward), _schedule(backward)
        fw, bw = timelines or self.timelines(fw_s, bw_s, facts)
        params, others = parameter_bytes(fw_s, bw_s, facts)
        return StepMemory(parameters=params, other_resident=others, optimizer_state=optimizer_state,
                          saved_activations=saved_bytes(fw_s, bw_s, facts), gradients=bw.output_bytes,
                          forward_peak=fw.peak, backward_peak=bw.peak,
                          forward_peak_at=_where(fw), backward_peak_at=_where(bw))

    def timelines(self, forward, backward, facts=None) -> tuple[Timeline, Timeline]:
        """The forward's and the backward's; with `holds_outputs`, the forward's user outputs
        (returned values the backward does not take) stay live through the backward."""
        fw_s, bw_s = _schedule(forward), _schedule(backward)
        resident = resident_keys(fw_s, facts)
        taken = {n.name for n in bw_s.inputs}
        held = [n for n in fw_s.outputs if n is not None and n.name not in taken] if self.holds_outputs else []
        scratch = facts.per_node(self.scratch) if facts else self.scratch
        return (self.memory.timeline(fw_s, resident, workspace=scratch, facts=facts),
                self.memory.timeline(bw_s, resident, frees_inputs=self.backward_frees_inputs, held=held,
                                     workspace=scratch, facts=facts))


def _schedule(graph) -> Schedule:
    return graph if isinstance(graph, Schedule) else schedule_of(graph)


def resident_keys(forward: Schedule, facts=None) -> set:
    """Storage keys of the forward's inputs (parameters, buffers, the step's inputs)."""
    facts = facts or FreshFacts()
    return {key for n in forward.inputs for key, _, _ in facts.storages(n)}


def _where(t: Timeline) -> str:
    node = t.peak_node
    if node is None:
        return "start"
    path = module_path(node) or traced_module_path(node)
    return f"{node.name}" + (f" in {path}" if path else "")




def parameter_bytes(forward: Schedule, backward: Schedule, facts=None) -> tuple[int, int]:
    """(bytes of the inputs that get a gradient, bytes of the other inputs), distinct storages.
    The backward returns one gradient (or None) per forward input, in order."""
    inputs = forward.inputs
    grads = list(backward.outputs)
    grads += [None] * (len(inputs) - len(grads))
    sizes: dict = {}
    with_grad = set()
    facts = facts or FreshFacts()
    for node, grad in zip(inputs, grads):
        for key, nbytes, _ in facts.storages(node):
            sizes[key] = nbytes
            if grad is not None:
                with_grad.add(key)
    params = sum(sizes[k] for k in with_grad)
    return params, sum(sizes.values()) - params


def saved_bytes(forward: Schedule, backward: Schedule, facts=None) -> int:
    """Distinct storages the forward returns for the backward (the saved activations), not
    counting resident ones (parameters, inputs)."""
    facts = facts or FreshFacts()
    resident = resident_keys(forward, facts)
    taken = {n.name for n in backward.inputs}
    sizes = {}
    for arg in forward.outputs:
        if arg is not None and arg.name in taken:
            for key, nbytes, _ in facts.storages(arg):
                if key not in resident:
                    sizes[key] = nbytes
    return sum(sizes.values())


def optimizer_state_bytes(optimizer, parameters) -> int:
    """Bytes of optimizer state: "adamw"/"adam" = two fp32 values per parameter, "sgd" = none
    (momentum: one per parameter with "sgd-momentum"); an optimizer instance counts its state if
    it has any, else what its type allocates on the first step."""
    params = list(parameters)
    numel = sum(p.numel() for p in params)
    if optimizer is None:
        return 0
    if isinstance(optimizer, str):
        per_param = {"adamw": 8, "adam": 8, "sgd": 0, "sgd-momentum": 4}
        if optimizer.lower() not in per_param:
            raise ValueError(f"unknown optimizer {optimizer!r}; name one of {sorted(per_param)} or pass an instance")
        return per_param[optimizer.lower()] * numel
    if optimizer.state:
        from picofx.cost.memory import resident_bytes

        return resident_bytes(optimizer)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 2 * param_bytes + 4 * len(params)  # exp_avg, exp_avg_sq, and a float32 step count each
    if isinstance(optimizer, torch.optim.SGD):
        return param_bytes if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    raise ValueError(f"cannot predict the state of {type(optimizer).__name__} before its first step; "
                     "run one step first or pass its state size")
