"""The Inductor memory model: which values Inductor keeps in registers, which kernels it fuses
and in what order, which buffers it reuses, and the scratch its extern kernels take."""
from picofx.cost.inductor.kernel_order import inductor_fusion
from picofx.cost.inductor.workspace import workspace_bytes

__all__ = ["inductor_fusion", "workspace_bytes"]
