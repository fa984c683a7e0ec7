"""What the codecs keep between steps, typed per use, in one CompressionState per optimized model.

The graphs hold these tensors as buffers and update them in place, so a state is made once and
outlives recompiles. CompressionState is a DCP `Stateful`; its keys (unchanged since the codecs
were two families):
    "rank<r>/residual/<parameter>"        error feedback, per parameter (all-reduced buckets, and
                                          top-k and PowerSGD under Shard: they run on whole gradients)
    "rank<r>/residual/shard_bucket<k>"    error feedback of Shard's int8 bucket k, in its padded layout
    "powersgd<R>/<parameter>"             PowerSGD's Q at rank R, the same on every rank
    "ranks<a>_<b>.../powersgd<R>/<parameter>"  the same, where the exchange's ranks (a, b, ...) are
                                          not the whole world (beside tensor or pipeline parallelism,
                                          whose ranks hold other pieces under the same names)
    "rank<r>/error/<first parameter>"     the bucket's last relative error (for the report)
Each rank's own tensors carry its global rank, so loading needs the same world and layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Residuals:
    """Error feedback: what this rank's compressor left out of its last step, added to the next."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def get(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        if name not in self.tensors:
            self.tensors[name] = torch.zeros(shape, dtype=dtype, device=device)
        return self.tensors[name]

    @torch.no_grad()
    def reset(self) -> None:
        for value in self.tensors.values():
            value.zero_()


@dataclass
class PowerSGDFactors:
    """PowerSGD's Q per (approximation rank, parameter): each step starts from the last one's."""

    tensors: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    first: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    def get(self, rank: int, name: str, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
        key = (rank, name)
        if key not in self.tensors:
            self.first[key] = first_q(cols, rank, dtype, device)
            self.tensors[key] = self.first[key].clone()
        return self.tensors[key]

    @torch.no_grad()
    def reset(self) -> None:
        for key, value in self.tensors.items():
            value.copy_(self.first[key])


def first_q(cols: int, rank: int, dtype, device) -> torch.Tensor:
    """The same orthonormal start on every rank (a fixed seed), as torch's PowerSGD hook."""
    q = torch.randn(cols, rank, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    return torch.linalg.qr(q).Q.to(dtype=dtype, device=device)


@dataclass
class RelativeErrors:
    """Per bucket, by its first parameter: ||left out|| / ||input|| of the last compressed step, one
    element each (this rank's own)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def get(self, name: str, device) -> torch.Tensor:
        if name not in self.tensors:
            self.tensors[name] = torch.zeros(1, dtype=torch.float32, device=device)
        return self.tensors[name]

    @torch.no_grad()
    def reset(self) -> None:
        for value in self.tensors.values():
            value.zero_()


class CompressionState:
    """The codecs' state for one optimized model on one rank. A DCP `Stateful`:
    `dcp.save({"model": ..., "compression": state})` saves it, `dcp.load` restores it in place."""

    def __init__(self, rank: int, replicas: str = ""):
        self.rank, self.replicas = rank, replicas
        self.residuals = Residuals()
        self.powersgd = PowerSGDFactors()
        self.relative_errors = RelativeErrors()

    @classmethod
    def for_dim(cls, dim) -> "CompressionState":
        """The state of this rank's exchange over the mesh dimension `dim` (a MeshDim)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return cls(dim.rank)
        ranks = dim.ranks()
        shared = "" if len(ranks) == dist.get_world_size() else "ranks" + "_".join(map(str, ranks))
        return cls(dist.get_rank(), shared)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by its key (without the rank prefix the saved keys add)."""
        return {**{f"residual/{k}": v for k, v in self.residuals.tensors.items()},
                **{f"powersgd{r}/{name}": v for (r, name), v in self.powersgd.tensors.items()},
                **{f"error/{k}": v for k, v in self.relative_errors.tensors.items()}}

    def reset(self) -> None:
        """Residuals and errors back to zero, Q back to its first value (as after optimize)."""
        self.residuals.reset()
        self.powersgd.reset()
        self.relative_errors.reset()

    def errors(self) -> dict[str, float]:
        """The last compressed step's relative error per bucket, by the bucket's first parameter:
        what this rank's compressor left out of its input, ||left out|| / ||input||."""
        return {k: v.item() for k, v in self.relative_errors.tensors.items()}

    def saved_name(self, key: str) -> str:
        if key.startswith(("residual/", "error/")):
            return f"rank{self.rank}/{key}"
        return f"{self.replicas}/{key}" if self.replicas else key

    def state_dict(self) -> dict:
        return {self.saved_name(k): v for k, v in self.tensors.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for key, value in self.tensors.items():
            value.copy_(state[self.saved_name(key)])
