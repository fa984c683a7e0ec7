"""pipeline: the step cut into stage graphs, balanced by cost, run by torch.distributed.pipelining."""
from picofx.passes.pipeline.pipeline import Pipeline

__all__ = ["Pipeline"]
