"""picofx's passes, one module each; importing this package registers them by name."""
from picofx.passes.precision.precision import Precision  # noqa: F401  (registers "precision")
from picofx.passes.fuse.fuse import Fuse, FuseLoss  # noqa: F401  (registers "fuse" and "fuse_loss")
from picofx.passes.checkpoint.checkpoint import Checkpoint  # noqa: F401  (registers "checkpoint")
from picofx.passes.overlap.overlap import Overlap  # noqa: F401  (registers "overlap")
from picofx.passes.pipeline.pipeline import Pipeline  # noqa: F401  (registers "pipeline")
from picofx.passes.shard.shard import Shard  # noqa: F401  (registers "shard")
from picofx.passes.tensor_parallel.tensor_parallel import TensorParallel  # noqa: F401  (registers "tensor_parallel")
from picofx.passes.context_parallel.context_parallel import ContextParallel  # noqa: F401  (registers "context_parallel")
