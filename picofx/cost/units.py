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
        match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", budget)
        unit = match.group(2).lower() if match else ""
        if match and unit in ("k", "m", "g", "t"):  # 8G: binary or decimal? ask
            number, letter = match.group(1), match.group(2).upper()
            raise ValueError(f"budget {budget!r} is ambiguous: write '{number}{letter}iB' "
                             f"(powers of 1024) or '{number}{letter}B' (powers of 1000)")
        if not match or unit not in _UNITS:
            raise ValueError(f"cannot read budget {budget!r}: write bytes with a unit, e.g. '8GiB', '512MiB', "
                             "'1.5GB', or pass an int (bytes) or a float (fraction of the peak)")
        if not unit and 0 < float(match.group(1)) < 1:
            raise ValueError(f"budget {budget!r} has no unit, so it reads as {match.group(1)} bytes: a fraction "
                             f"of the peak is a float (budget={match.group(1)}), bytes need a unit ('512MiB')")
        value = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"a budget is bytes (int), a size string or a fraction (float), got {budget!r}")
    if value <= 0:
        raise ValueError(f"a budget is a positive amount of memory, got {budget!r}")
    return value


def check_budget(budget) -> None:
    """Raise now, saying what to write instead, if `budget` cannot be a budget (checked when a pass
    is built, before any capture; a fraction is resolved later against the predicted peak)."""
    if isinstance(budget, float):
        if budget <= 0:
            raise ValueError(f"a budget is a positive amount of memory, got {budget!r}")
        if budget > 1:
            raise ValueError(f"budget {budget!r} is a float, which means a fraction of the predicted peak "
                             f"(0 < fraction <= 1); for bytes pass an int ({int(budget):_}) or a string ('8GiB')")
        return
    parse_budget(budget)
