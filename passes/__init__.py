"""picofx's passes, one module each; importing this package registers them by name."""
from picofx.passes.precision import Precision  # noqa: F401  (registers "precision")
from picofx.passes.fuse import Fuse  # noqa: F401  (registers "fuse")
from picofx.passes.checkpoint import Checkpoint  # noqa: F401  (registers "checkpoint")
from picofx.passes.overlap import Overlap  # noqa: F401  (registers "overlap")
from picofx.passes.pipeline import Pipeline  # noqa: F401  (registers "pipeline")
from picofx.passes.shard import Shard  # noqa: F401  (registers "shard")
from picofx.passes.tensor_parallel import TensorParallel  # noqa: F401  (registers "tensor_parallel")
