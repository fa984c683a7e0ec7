"""The Inductor memory model: which values Inductor keeps in registers, which kernels it fuses
and in what order, which buffers it reuses, and the scratch its extern kernels take; behind one
interface, `InductorMemoryModel` (`memory_model_for(backend)` picks it or graph-order liveness),
with Inductor's thresholds read from its config when asked (`InductorSwitches`)."""
from picofx.cost.inductor.kernel_order import inductor_fusion
from picofx.cost.inductor.model import GraphOrderMemoryModel, InductorMemoryModel, memory_model_for
from picofx.cost.inductor.switches import CHECKED_TORCH, InductorSwitches
from picofx.cost.inductor.workspace import workspace_bytes

__all__ = ["CHECKED_TORCH", "GraphOrderMemoryModel", "InductorMemoryModel", "InductorSwitches", "inductor_fusion",
           "memory_model_for", "workspace_bytes"]
