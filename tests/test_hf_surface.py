"""The Hugging Face surface of an optimized module answers from what the passes declare."""
from torch import nn

import picofx


def test_the_trainer_surface_reads_what_passes_declare_not_their_names():
    from picofx.manager import PassInfo, Stage
    from picofx.runtime.hf import optimized_class

    class Averaging:  # a user's own data-parallel pass, under a name picofx does not know
        info = PassInfo(Stage.PARTITIONED, mesh_dims=("dp_replicate",), communicates=True)

    class Recomputing:
        info = PassInfo(Stage.JOINT, plans_partition=True, tags_only=True)

    model = nn.Linear(4, 4)
    declared = optimized_class(picofx.OptimizedModule, model, None, [Averaging(), Recomputing()])
    plain = optimized_class(picofx.OptimizedModule, model, None, [])
    for prop in ("syncs_gradients", "is_activation_checkpointing"):
        assert getattr(declared, prop).fget(declared) and not getattr(plain, prop).fget(plain)
