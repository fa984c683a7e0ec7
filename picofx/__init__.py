"""picofx: compiler passes over torch.fx graphs that make LLaMA-style training faster and leaner.

    capture/   model -> ATen forward graph, annotated        manager/  passes, stages, verify, report, dump
    rewrite/   the rule API (pattern -> replacement)          cost/     devices, FLOPs, memory, plans
    runtime/   compiling and running the step                 kernels/  the fused ops (CPU and Triton)
    passes/    fuse, precision, checkpoint, overlap, shard, tensor_parallel, pipeline
    planner/   layouts predicted and ranked (picofx.plan)     cli/      picofx train | plan | dump
"""
import importlib.metadata

from picofx.errors import BudgetError, CaptureError, DistributedError, InputShapeError, PassError, VerificationError
from picofx.manager import Context, DumpGraphs, PassManager, PassResult, Stage, register_pass
from picofx.api import OptimizedModule, optimize
from picofx import rules  # noqa: E402  (public module: picofx.rules.Rule)
from picofx.cost import device  # noqa: E402  (picofx.device.H100, picofx.device.calibrate)
from picofx.diagnose.profiler import profile  # noqa: E402  (picofx.profile: a trace of one's own loop's steps)


try:
    __version__ = importlib.metadata.version("picofx")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

# Last: the passes register their names (and the fuse rules) as they are imported.
from picofx import passes  # noqa: E402,F401  isort: skip
# The planner composes passes: it comes after them.
from picofx.planner.api import plan  # noqa: E402  isort: skip

__all__ = ["BudgetError", "CaptureError", "Context", "DistributedError", "DumpGraphs", "InputShapeError", "OptimizedModule", "PassError",
           "PassManager", "PassResult", "Stage", "VerificationError", "device", "optimize", "passes", "plan",
           "profile", "register_pass", "rules"]
