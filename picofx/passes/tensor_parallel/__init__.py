"""tensor_parallel: Megatron tensor (and sequence) parallelism, its plan read from the graph."""
from picofx.passes.tensor_parallel.tensor_parallel import TensorParallel

__all__ = ["TensorParallel"]
