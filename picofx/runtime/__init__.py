"""The runtime: compiling the transformed step for training (eager or Inductor), running the
joint and partitioned stages inside that compilation."""
from picofx.runtime.compile import compile_graph

__all__ = ["compile_graph"]
