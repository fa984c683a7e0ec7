"""The Inductor memory model behind one interface: the bytes live at each step of a graph that
Inductor compiles.

`InductorMemoryModel.timeline` runs the mirrored rules (`inductor_fusion`: values in registers,
fused kernels and their order, in-place writes, the free list) with Inductor's thresholds and
switches as its config sets them at that moment (`picofx.cost.inductor.switches`). When the rules
cannot be vouched for (a torch release they were not checked against, or a memory-relevant
switch they do not follow), it warns once per process and asks Inductor itself: it compiles the
graph with Inductor and measures its peak (`picofx.cost.inductor.measured`), keeping the
graph-order timeline's shape, shifted to that peak.
"""
from __future__ import annotations

import warnings

from picofx.cost.inductor.kernel_order import inductor_fusion
from picofx.cost.inductor.measured import measured_peak
from picofx.cost.inductor.switches import InductorSwitches, unvouched
from picofx.cost.liveness import Schedule, Timeline, timeline

_warned: set[str] = set()  # reasons already warned about in this process


def warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"{reason}; picofx predicts Inductor's peak memory by compiling each graph and "
                      "measuring it, which is slow (graph by graph, tens of seconds each)", stacklevel=3)


class InductorMemoryModel:
    """Live bytes per step as Inductor's generated code runs a schedule."""

    fuses_pointwise = True

    def timeline(self, schedule: Schedule, resident: set, *, frees_inputs: bool = True, held=(),
                 workspace=None, facts=None) -> Timeline:
        """`facts`: a `picofx.cost.liveness.NodeFacts` kept across simulations of one graph."""
        reason = unvouched()
        if reason is not None:
            warn_once(reason)
            return self.measured_timeline(schedule, resident, frees_inputs=frees_inputs, held=held,
                                          workspace=workspace)
        ordered, fusion = inductor_fusion(schedule, InductorSwitches.current())
        return timeline(ordered, resident, frees_inputs=frees_inputs, held=held, workspace=workspace, fusion=fusion,
                        facts=facts)

    @staticmethod
    def measured_timeline(schedule: Schedule, resident: set, *, frees_inputs: bool = True, held=(),
                          workspace=None) -> Timeline:
        """Graph order's timeline, shifted so that its peak is the peak Inductor's compiled code
        reaches on random inputs of the schedule's shapes."""
        line = timeline(schedule, resident, frees_inputs=frees_inputs, held=held, workspace=workspace)
        if not line.live:
            return line
        shift = measured_peak(schedule, resident, frees_inputs=frees_inputs, held=held) - line.peak
        return Timeline(line.nodes, [live + shift for live in line.live], line.input_bytes, line.output_bytes,
                        line.allocated_by)


class GraphOrderMemoryModel:
    """Live bytes per step as the graph runs node by node (the eager backend)."""

    fuses_pointwise = False

    def timeline(self, schedule: Schedule, resident: set, *, frees_inputs: bool = True, held=(),
                 workspace=None, facts=None) -> Timeline:
        return timeline(schedule, resident, frees_inputs=frees_inputs, held=held, workspace=workspace, facts=facts)


def memory_model_for(backend: str) -> InductorMemoryModel | GraphOrderMemoryModel:
    """The model of the graphs `backend` ("eager" or "inductor") runs."""
    return InductorMemoryModel() if backend == "inductor" else GraphOrderMemoryModel()
