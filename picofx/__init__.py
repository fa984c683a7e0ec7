"""picofx: compiler passes over torch.fx graphs that make LLaMA-style training faster and leaner."""
from picofx.capture import CaptureError, capture
from picofx.dump import DumpGraphs
from picofx.optimize import InputShapeError, OptimizedModule, optimize
from picofx.pass_manager import Context, PassError, PassManager, PassResult, Stage, register_pass
from picofx.verify import VerificationError

__all__ = ["CaptureError", "Context", "DumpGraphs", "InputShapeError", "OptimizedModule", "PassError",
           "PassManager", "PassResult", "Stage", "VerificationError", "capture", "optimize", "register_pass"]
