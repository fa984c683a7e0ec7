"""Every error picofx raises on purpose, in one place; each message says where and what to do."""
from __future__ import annotations


class CaptureError(RuntimeError):
    """The model cannot be captured as one graph; the message says where, why and what to do."""


class PassError(RuntimeError):
    """A pass raised or failed verification; the graph is left as it was before the pass."""


class VerificationError(AssertionError):
    """A graph broke an invariant or changed the numbers; the message says which and how to fix it."""


class InputShapeError(ValueError):
    """A call's inputs differ from the captured ones and recapture is off."""


class BudgetError(ValueError):
    """A memory budget cannot be met; the message says the smallest achievable peak and what fits.
    `smallest_peak` (bytes) and `batch_that_fits` (or None) say it as numbers."""

    def __init__(self, message: str, smallest_peak: int | None = None, batch_that_fits: int | None = None):
        super().__init__(message)
        self.smallest_peak, self.batch_that_fits = smallest_peak, batch_that_fits


class PassBudgetError(PassError, BudgetError):
    """A BudgetError raised by a pass, as the pass manager reports it: it names the pass and says the
    graph was restored, and is caught by `except picofx.BudgetError` as by `except picofx.PassError`."""

    def __init__(self, message: str, smallest_peak: int | None = None, batch_that_fits: int | None = None):
        BudgetError.__init__(self, message, smallest_peak, batch_that_fits)


class DistributedError(RuntimeError):
    """A distributed run is set up wrongly (no process group, a mesh that does not match the world,
    ranks whose models or layouts differ); raised before any rank waits, on every rank it concerns."""
