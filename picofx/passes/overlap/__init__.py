"""overlap: data parallel as bucketed gradient all-reduces written into the backward graph."""
from picofx.passes.overlap.overlap import Overlap

__all__ = ["Overlap"]
