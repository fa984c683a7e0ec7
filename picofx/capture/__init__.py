"""Capture: a model's training step (forward and loss) exported to an ATen-level FX graph, each
node annotated with its fake value, FLOPs, bytes and module path."""
from picofx.capture.annotate import annotate
from picofx.capture.export import Signature, capture, capture_call, input_key, split_inputs
from picofx.errors import CaptureError

__all__ = ["CaptureError", "Signature", "annotate", "capture", "capture_call", "input_key", "split_inputs"]
