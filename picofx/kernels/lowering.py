"""Which fused ops Inductor launches as picofx's Triton kernels when it compiles for CUDA.

Inductor can lower each pointwise fused op two ways, and both leave no opaque call behind:
- decomposed: `picofx.kernels.inductor_decompositions()` turns it into plain ATen ops that
  Inductor fuses with the op's neighbours (every device);
- as a kernel: picofx's Triton kernel, launched through `torch.library.wrap_triton`, so the
  generated code calls the kernel itself and Inductor plans its buffers. This is how
  `torch.library.triton_op` works (its body runs under AOT's functionalization), applied here to
  the existing custom ops so that their autograd formulas stay as they are.

An op takes the second way inside `with triton_lowering(names)` for the ops named there (a backward
op, such as rms_norm_backward, also for the forward ops it serves). Outside, or under export,
the op stays one node and its decomposition, if given, applies further down.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterable

import torch
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch._subclasses.fake_tensor import FakeTensor

_LOWERED: ContextVar[frozenset] = ContextVar("picofx_triton_lowered", default=frozenset())
TRITON_KERNELS: dict[str, Callable] = {}       # "picofx::rms_norm" -> the function that launches its kernel
SERVES: dict[str, tuple[str, ...]] = {}        # a backward op -> the forward ops whose autograd calls it


def register_triton_lowering(op, launch: Callable, *, serves: tuple[str, ...] = ()) -> None:
    """Let `op` (a torch.library custom op) lower to `launch`, which calls its Triton kernels through
    wrap_triton; `serves`: for a backward op, the forward ops (names "picofx::...") it belongs to."""
    name = op._qualname
    TRITON_KERNELS[name] = launch
    SERVES[name] = serves

    def functional(mode, func, types, args, kwargs):
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        known = all(issubclass(t, (FakeTensor, FunctionalTensor)) or t is torch.Tensor for t in types)
        if name not in _LOWERED.get() or custom_triton_ops_decomposition_disabled() or not known:
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:
            return launch(*args, **kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, functional)


def with_backward_ops(names: Iterable[str]) -> frozenset:
    """`names` and the backward ops that serve any of them."""
    names = set(names)
    return frozenset(names | {b for b, forward in SERVES.items() if names & set(forward)})


@contextmanager
def triton_lowering(names: Iterable[str]):
    """Within: the fused ops named (and their backward ops) lower to their Triton kernels."""
    unknown = set(names) - set(TRITON_KERNELS)
    if unknown:
        raise KeyError(f"triton_lowering: no Triton kernel for {sorted(unknown)}; "
                       f"these have one: {', '.join(sorted(TRITON_KERNELS)) or 'none (triton is not installed)'}")
    token = _LOWERED.set(with_backward_ops(names))
    try:
        yield
    finally:
        _LOWERED.reset(token)


def has_triton_kernel(name: str) -> bool:
    return name in TRITON_KERNELS
