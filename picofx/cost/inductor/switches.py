"""The thresholds and switches of Inductor that the memory model mirrors, read from
`torch._inductor.config` each time a graph is modelled, so `torch._inductor.config.patch(...)`
and a user's own settings are honoured.

The rules themselves (which values stay in registers, which kernels fuse, how buffers are reused)
were checked against the Inductor of the torch releases in `CHECKED_TORCH`. On another release,
or with a memory-relevant switch the model does not mirror set away from the value it was checked
with (`UNMIRRORED`), the model cannot vouch for its rules: `InductorMemoryModel`
(`picofx.cost.inductor.model`) then warns once and asks Inductor itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._inductor import config

CHECKED_TORCH = ("2.13",)  # major.minor releases whose Inductor the rules were checked against
# Scheduler.are_long_distant_nodes: kernels whose places in the node list are farther apart than
# this do not fuse. A literal in Inductor's code, not a config entry.
LONG_DISTANCE = 64
# Switches that change what Inductor allocates but that the model does not follow, with the values
# the model was checked with.
UNMIRRORED = {"realize_opcount_threshold": None, "realize_acc_reads_size_threshold": None,
              "aggressive_fusion": False, "memory_planning": False, "max_fusion_unique_io_buffers": None,
              "reorder_for_peak_memory": True}


@dataclass(frozen=True)
class InductorSwitches:
    """What the model mirrors, each named after the config entry it comes from."""

    max_fusion_size: int = 64  # nodes one fused kernel may hold
    pairwise_attempts: int = 64  # max_fusion_buffer_group_pairwise_attempts: readers of a buffer paired
    score_fusion_memory_threshold: int = 10  # bytes two kernels must share to fuse
    realize_reads_threshold: int = 4  # loads above which a value read twice gets a buffer
    acc_reads_threshold: int = 8  # realize_acc_reads_threshold: loads above which a value gets a buffer
    cpu_acc_reads_threshold: int = 12  # the same on CPU (realize_cpu_acc_reads_threshold)
    inplace_buffers: bool = True  # a kernel may write into a dying input
    allow_buffer_reuse: bool = True  # freed buffers are kept for the next allocation of their size
    long_distance: int = LONG_DISTANCE

    @classmethod
    def current(cls) -> InductorSwitches:
        """The values in `torch._inductor.config` now."""
        acc = config.realize_acc_reads_threshold
        return cls(max_fusion_size=config.max_fusion_size,
                   pairwise_attempts=config.max_fusion_buffer_group_pairwise_attempts,
                   score_fusion_memory_threshold=config.score_fusion_memory_threshold,
                   realize_reads_threshold=config.realize_reads_threshold,
                   acc_reads_threshold=config._realize_acc_reads_threshold_default if acc is None else acc,
                   cpu_acc_reads_threshold=config.realize_cpu_acc_reads_threshold if acc is None else acc,
                   inplace_buffers=config.inplace_buffers, allow_buffer_reuse=config.allow_buffer_reuse)

    def max_reads(self, on_cpu: bool) -> int:
        return self.cpu_acc_reads_threshold if on_cpu else self.acc_reads_threshold


def torch_release() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def unvouched() -> str | None:
    """Why the mirrored rules may not hold now (another torch release, or a switch the model does
    not follow set away from its checked value), or None when they do."""
    if torch_release() not in CHECKED_TORCH:
        return (f"torch {torch.__version__}: the Inductor memory model was checked against torch "
                f"{', '.join(CHECKED_TORCH)}")
    changed = [f"{name}={getattr(config, name)!r}" for name, checked in UNMIRRORED.items()
               if getattr(config, name) != checked]
    if changed:
        return f"torch._inductor.config sets {', '.join(changed)}, which the Inductor memory model does not mirror"
    return None
