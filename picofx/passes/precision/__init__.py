"""precision: mixed precision as casts in the graph, by rule and by measured sensitivity."""
from picofx.passes.precision.precision import Precision

__all__ = ["Precision"]
