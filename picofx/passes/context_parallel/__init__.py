"""context_parallel: the sequence split over the cp ranks, attention over every key (all-gather or ring)."""
from picofx.passes.context_parallel.context_parallel import ContextParallel

__all__ = ["ContextParallel"]
