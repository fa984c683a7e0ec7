"""The parallel layer under the distributed passes and their runtime: the run's mesh of ranks
(`mesh.py`: named dimensions over a DeviceMesh, process groups resolved there only) and the
layouts passes decide and the runtime applies (`layouts.py`)."""
from picofx.parallel.layouts import BucketLayout, GraphLayouts, PipelineLayout, StageSignature, layouts_of, recorded
from picofx.parallel.mesh import DIMS, MeshDim, ParallelMesh, resolve_dim

__all__ = ["DIMS", "BucketLayout", "GraphLayouts", "MeshDim", "ParallelMesh", "PipelineLayout", "StageSignature",
           "layouts_of", "recorded", "resolve_dim"]
