"""The description of a device the cost model reads (peaks, memory, links): the dataclasses the
GPU profiles (picofx.cost.gpus) and the CPU entry and calibration (picofx.cost.device) both build."""
from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Link:
    """What a collective sees of a connection between ranks."""

    name: str
    bandwidth: float  # bytes/s one way per rank
    latency: float  # s per message (one step of a ring)
    source: str = "datasheet"
    call_latency: float = 0.0  # s once per collective beyond its steps (ranks sharing cores: waking the peers)


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: dict  # torch.dtype -> dense FLOP/s
    memory_bandwidth: float  # bytes/s, device memory
    memory_capacity: int  # bytes
    link_bandwidth: float  # bytes/s one way to a peer in the same node (NVLink)
    link_latency: float  # s, one small message to a peer in the same node
    network_bandwidth: float  # bytes/s one way to another node
    network_latency: float  # s
    op_overhead: float = 5e-6  # s per op: kernel launch or eager dispatch (typical, not datasheet)
    optimizer_tensor_overhead: float = 0.0  # s per parameter tensor per AdamW step beyond its bytes (calibrated)
    dtensor_parameter_overhead: float = 0.0  # s per DTensor parameter per step beyond a plain one's (calibrated)
    cpu_share: float = 1.0  # of a core each rank gets (ranks sharing cores: calibrated)
    collective_latency: float = 0.0  # s once per collective beyond its ring steps (ranks sharing cores: calibrated)
    source: str = "datasheet"
    link_name: str = "NVLink 4"
    network_name: str = "InfiniBand NDR 400 Gb/s"
    link_source: str = "datasheet bandwidth, typical NCCL latency"

    @property
    def intra_node_link(self) -> Link:
        return Link(self.link_name, self.link_bandwidth, self.link_latency, self.link_source, self.collective_latency)

    @property
    def inter_node_link(self) -> Link:
        return Link(self.network_name, self.network_bandwidth, self.network_latency, self.link_source,
                    self.collective_latency)

    def network_link(self, ranks_per_node: int) -> Link:
        """The network as a group with `ranks_per_node` of its ranks in each node sees it: here one
        link whatever the group; a GPU profile counts the group's network ports."""
        return self.inter_node_link

    def flops_per_second(self, dtype: torch.dtype) -> float:
        """Peak for `dtype`; a dtype the entry does not list runs at the fp32 rate."""
        return self.peak_flops.get(dtype, self.peak_flops[torch.float32])

    # What kernels reach: the peaks here; a GPU profile (picofx.cost.gpus) says less.
    def matmul_rate(self, dtype: torch.dtype, smallest_dim: int) -> float:
        return self.flops_per_second(dtype)

    def attention_rate(self, dtype: torch.dtype, backward: bool, causal: bool) -> float:
        return self.flops_per_second(dtype)

    def pointwise_bandwidth(self) -> float:
        return self.memory_bandwidth
