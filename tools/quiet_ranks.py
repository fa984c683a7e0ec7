"""torch's lines that say nothing about a tool's results, kept off the terminal: at their cause
where the tool can change it, else filtered one message at a time."""
from __future__ import annotations

import logging
import threading

from tqdm import tqdm

# Dynamo, compiling DistributedDataParallel.forward, says once per process that it drops DDP's
# profiler range. The "DDP + torch.compile" contender runs as users run it, so the line is filtered.
IGNORED_RECORD_FUNCTION = "Profiler record function %s will be ignored"


class _DropMessage(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.message


def quiet_rank() -> None:
    """Call first in a rank process that ends with os._exit (as picofx.parallel.launch's ranks do)."""
    # Inductor's compile progress bar makes tqdm create a multiprocessing lock; os._exit skips the
    # finalizer that frees its semaphore, and the launcher's resource tracker then warns of a leaked
    # semaphore at exit, once per rank. A rank draws no bars from other processes: a thread lock serves.
    tqdm.set_lock(threading.RLock())
    logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(_DropMessage(IGNORED_RECORD_FUNCTION))
