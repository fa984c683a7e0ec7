"""Byte counts as people write them: formatting for reports, parsing for budgets."""
from __future__ import annotations

import re

MiB = 2**20
GiB = 2**30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def parse_budget(budget, reference: int | None = None) -> int:
    """Bytes from an int (bytes), a string ("8GiB", "512MiB", "1.5GB", "1e9") or a float, which is
    a fraction of `reference` (the predicted peak without checkpointing)."""
    if isinstance(budget, bool):
        raise TypeError("a budget is bytes (int), a size string or a fraction (float), not a bool")
    if isinstance(budget, int):
        value = budget
    elif isinstance(budget, float):
        if reference is None:
            raise ValueError(f"budget {budget} is a fraction, but there is no reference peak to take it of")
        value = int(budget * reference)
    elif isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", budget)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read budget {budget!r}: write bytes with a unit, e.g. '8GiB', '512MiB', "
                             "'1.5GB', or pass an int (bytes) or a float (fraction of the peak)")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise TypeError(f"a budget is bytes (int), a size string or a fraction (float), got {budget!r}")
    if value <= 0:
        raise ValueError(f"budget must be positive, got {budget!r}")
    return value
