"""checkpoint: what the backward recomputes instead of saving, chosen by the memory cost model."""
from picofx.passes.checkpoint.checkpoint import Checkpoint

__all__ = ["Checkpoint"]
