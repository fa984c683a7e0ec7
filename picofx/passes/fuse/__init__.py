"""fuse: pattern rules that replace norms, projections, attention, RoPE and the loss with fused ops."""
from picofx.passes.fuse.fuse import Fuse, FuseLoss

__all__ = ["Fuse", "FuseLoss"]
