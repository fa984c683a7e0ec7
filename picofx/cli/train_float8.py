"""`picofx train --float8 RECIPE [--float8-layers auto|all|GLOB,...]`: the precision pass with float8,
added to the compute passes when --passes lacks it."""
from __future__ import annotations

from picofx.passes import Precision


def float8_layers(text: str):
    """"auto", "all", or comma-separated module-path globs."""
    return text if text in ("auto", "all") else tuple(g.strip() for g in text.split(",") if g.strip())


def compute_passes(args) -> list:
    """--passes without checkpoint (planned apart), precision carrying --float8 when asked."""
    names = [name for name in args.passes if name != "checkpoint"]
    recipe = getattr(args, "float8", None)
    if recipe is None:
        return names
    precision = Precision(float8=recipe, float8_layers=float8_layers(args.float8_layers))
    if "precision" in names:
        return [precision if name == "precision" else name for name in names]
    return [*names, precision]


def layout_precision(args) -> str:
    """The run description's precision (picofx.planner.layouts.PRECISIONS) that --float8 gives."""
    recipe = getattr(args, "float8", None)
    return "bf16" if recipe is None else "float8" if recipe == "tensorwise" else "float8_rowwise"


def check_float8(args) -> None:
    """--float8-layers needs --float8; its value is checked as the pass checks it."""
    if getattr(args, "float8", None) is None:
        if getattr(args, "float8_layers", "auto") != "auto":
            raise ValueError("--float8-layers selects the layers --float8 runs in float8: add --float8 RECIPE")
        return
    try:
        Precision(float8=args.float8, float8_layers=float8_layers(args.float8_layers))
    except ValueError as e:
        raise ValueError(f"--float8-layers: {e}") from None
