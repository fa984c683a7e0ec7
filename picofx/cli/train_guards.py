"""picofx train's guards: gradient clipping that first checks the norm, a non-finite loss or gradient
that stops the run (or, with --skip-nonfinite, skips the step) on every rank at the same step, and
the collective watchdog (picofx.runtime.watchdog) with the phases of a step named by the collectives
the layout runs in them."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import pathlib
import sys

import torch
from tqdm import tqdm

DEFAULT_COLLECTIVE_TIMEOUT = 300  # seconds; torch's own default is 600


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def add_guard_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--collective-timeout", type=seconds, default=DEFAULT_COLLECTIVE_TIMEOUT, metavar="SECONDS",
                   help="under torchrun, when a rank stops answering for this long every other rank stops with "
                        "one line naming it, the step and the collective waited in (the process group's own "
                        "timeout is a little longer, for setup and as a backstop)")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip a step whose loss or gradient is not finite (no optimizer step; counted in the "
                        "summary) instead of stopping the run at it")
    p.add_argument("--metrics", metavar="FILE", help="rank 0 writes one JSON line per step: step, loss, learning "
                   "rate, gradient norm, tokens/s, MFU, peak memory (a resumed run appends)")
    p.add_argument("--tensorboard", metavar="DIR", help="the same per-step scalars as TensorBoard events in DIR "
                   "(needs the tensorboard package)")


def check_guard_options(args) -> None:
    """Raises ValueError (picofx train's usage error) for an option that cannot work."""
    if args.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"--tensorboard {args.tensorboard}: the tensorboard package is not installed: "
                         "pip install tensorboard (or write --metrics FILE, JSON lines, instead)")
    if args.metrics is not None:
        parent = pathlib.Path(args.metrics).resolve().parent
        existing = next((p for p in [parent, *parent.parents] if p.exists()), None)
        if pathlib.Path(args.metrics).is_dir() or (existing is not None and not existing.is_dir()):
            raise ValueError(f"--metrics {args.metrics}: not a file that can be written (a directory, or under a "
                             "file): name a file such as run/metrics.jsonl")


def group_timeout(collective_timeout: float) -> datetime.timedelta:
    """The process group's timeout: the watchdog's, and a margin for it to speak first."""
    return datetime.timedelta(seconds=collective_timeout + max(10.0, collective_timeout / 5))


def step_collectives(layout) -> str:
    """What a step's forward and backward exchanges, under picofx train's layout (a planner Layout)."""
    parts = [f"{layout.pp} pipeline stages' sends and receives" if layout.pp > 1 else "",
             "tensor-parallel all-reduces" if layout.tp > 1 else "",
             "shard's all-gathers and reduce-scatters" if layout.shard else "",
             "gradient all-reduces" if layout.dp_replicate > 1 else ""]
    return ", ".join(p for p in parts if p) or "no collective"


def copies_of(grad) -> int:
    """How many ranks hold the same piece of a DTensor gradient (its Replicate() mesh dimensions)."""
    if not hasattr(grad, "placements"):
        return 1
    return math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate())


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def gradient_norm(parameters, replicas: int | None) -> torch.Tensor:
    """The norm of the whole model's gradients, the same on every rank. Pipelined (`replicas` given),
    each rank holds one stage's (or, sharded, its piece of one): their squares are summed over all
    ranks, less the replicas' equal copies."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if replicas is None:
        return torch.nn.utils.get_total_norm(grads)  # a DTensor where the gradients are
    import torch.distributed as dist

    pieces = [local(g) for g in grads]  # sharded: each rank its piece
    copies = [copies_of(g) for g in grads]  # a piece whole on several tp ranks counts once
    square = torch.stack([g.pow(2).sum() / n for g, n in zip(pieces, copies)]).sum() if pieces else torch.zeros(())
    dist.all_reduce(square)
    return (square / replicas).sqrt()


def whole(norm: torch.Tensor) -> torch.Tensor:
    """The norm as a plain tensor (a DTensor's is gathered)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip_gradients(parameters, max_norm: float, norm: torch.Tensor, pipelined: bool) -> None:
    """Scale the gradients so that their whole norm (`gradient_norm`) is at most `max_norm`."""
    if not pipelined:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        return
    scale = min(1.0, max_norm / (norm.item() + 1e-6))
    for p in parameters:
        if p.grad is not None:
            local(p.grad).mul_(scale)


class NonFinite:
    """Checks each step's loss and gradient norm (one isfinite, agreed over every rank by one
    all-reduce): a non-finite step stops the run, naming the step and the first parameter (in the
    model's order) whose gradient is not finite, or with `skip` is counted and left out."""

    def __init__(self, *, skip: bool, world: int, order: list[str], speaks: bool, close):
        self.skip, self.world, self.speaks, self.close = skip, world, speaks, close
        self.order = {name: i for i, name in enumerate(order)}
        self.skipped: list[int] = []
        self.norm = math.nan  # the last step's gradient norm, before clipping

    def finite(self, step: int, loss: torch.Tensor, norm: torch.Tensor, named_parameters) -> bool:
        """Whether step `step` (counted from 1) may update the weights; stops the run where not and
        not skipping (every rank exits with status 1; the first says why)."""
        values = torch.stack([loss.detach().float().reshape(()), whole(norm).float().reshape(())])
        self.norm = values[1].item()
        bad = (~torch.isfinite(values)).any()
        bad = bad.float()
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if not bad.item():
            return True
        if self.skip:
            self.skipped.append(step)
            return False
        name = self.first_nonfinite(named_parameters)
        where = f"the gradient of {name} is not finite (the first parameter whose is)" if name else \
            "every gradient is finite"
        if self.speaks:  # below the progress bar, not on its line
            tqdm.write(f"picofx train: error: step {step}: the loss is {loss.item():g} and {where}; the run stops "
                       "(--skip-nonfinite skips such steps instead; a lower --lr often avoids them)", file=sys.stderr)
        self.close()
        raise SystemExit(1)

    def first_nonfinite(self, named_parameters) -> str | None:
        mine = min(((self.order.get(n, len(self.order)), n) for n, p in named_parameters
                    if p.grad is not None and not torch.isfinite(local(p.grad)).all()), default=None)
        found = [mine]
        if self.world > 1:
            import torch.distributed as dist

            found = [None] * self.world
            dist.all_gather_object(found, mine)
        found = [f for f in found if f is not None]
        return min(found)[1] if found else None

    def summary(self) -> str | None:
        if not self.skipped:
            return None
        shown = ", ".join(map(str, self.skipped[:10])) + (", ..." if len(self.skipped) > 10 else "")
        return (f"skipped {len(self.skipped)} step{'s' if len(self.skipped) > 1 else ''} with a non-finite loss or "
                f"gradient (--skip-nonfinite): step{'s' if len(self.skipped) > 1 else ''} {shown}")
