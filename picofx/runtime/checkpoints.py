"""A training run's checkpoints in one directory: `ROOT/step-N`, one per save, each complete only
once its marker file is written, which happens after every rank's write has finished. A save
writes in the background (torch.distributed.checkpoint.async_save: the state is copied first, so
the next steps may change it), one at a time; the oldest complete checkpoints beyond `keep` are
removed once a newer one is complete. SIGTERM or Ctrl-C asks for a checkpoint at the next step
boundary; a second Ctrl-C aborts at once."""
from __future__ import annotations

import os
import pathlib
import shutil
import socket
import signal
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

STEP_PREFIX = "step-"
COMPLETE = ".complete"  # written last, by the first rank, once every rank's write has finished


def step_directory(root, step: int) -> pathlib.Path:
    return pathlib.Path(root) / f"{STEP_PREFIX}{step}"


def step_of(path) -> int | None:
    """N for a directory named step-N, else None."""
    name = pathlib.Path(path).name
    digits = name[len(STEP_PREFIX):]
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


def is_complete(path) -> bool:
    return (pathlib.Path(path) / COMPLETE).is_file()


def saved_steps(root) -> list[tuple[int, pathlib.Path]]:
    """Every step-N directory under `root`, complete or not, oldest first."""
    root = pathlib.Path(root)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir()]
    return sorted((step, p) for step, p in found if step is not None)


def newest_complete(root) -> pathlib.Path | None:
    complete = [p for _, p in saved_steps(root) if is_complete(p)]
    return complete[-1] if complete else None


def prune(root, keep: int | None) -> list[pathlib.Path]:
    """Remove the complete checkpoints beyond the newest `keep`, and the incomplete ones older than
    the newest complete (interrupted writes, never to be loaded). Returns what was removed."""
    steps = saved_steps(root)
    complete = [p for _, p in steps if is_complete(p)]
    if not complete:
        return []
    newest = step_of(complete[-1])
    removed = complete[:-keep] if keep else []
    removed += [p for step, p in steps if step < newest and not is_complete(p)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


MISSING, INCOMPLETE, EMPTY = "missing", "incomplete", "empty"  # why find_checkpoint found none


def find_checkpoint(path) -> tuple[pathlib.Path | None, str | None]:
    """The checkpoint directory `path` names, or None and why (MISSING: no such directory;
    INCOMPLETE: a step-N whose write was interrupted; EMPTY: no complete checkpoint in it). A
    complete step-N is itself, so is a checkpoint written whole at the end of a run (its .metadata
    beside no step-N); a directory of step-N directories gives its newest complete one."""
    path = pathlib.Path(path)
    if not path.is_dir():
        return None, MISSING
    if step_of(path) is not None:
        return (path, None) if is_complete(path) else (None, INCOMPLETE)
    if (path / ".metadata").is_file() and not saved_steps(path):
        return path, None
    newest = newest_complete(path)
    return (newest, None) if newest is not None else (None, EMPTY)


def checkpoint_to_resume(resume: str, save: str | None) -> str | None:
    """The checkpoint directory `--resume` names: `auto` (the newest complete one under `save`, or
    None for a fresh start), else as find_checkpoint resolves it."""
    if resume == "auto":
        if save is None:
            raise ValueError("--resume auto: resumes from the newest checkpoint under --save DIR: pass --save DIR too")
        newest = newest_complete(save)
        return None if newest is None else str(newest)
    directory, reason = find_checkpoint(resume)
    if reason == INCOMPLETE:
        raise ValueError(f"--resume {resume}: this checkpoint is incomplete (its write was interrupted: no "
                         f"{COMPLETE} file): resume from an older one, or pass --resume auto with --save")
    if directory is None:
        raise ValueError(f"--resume {resume}: no checkpoint there (a directory written by --save holds step-N "
                         f"directories, each complete once its {COMPLETE} file is written)")
    return resume if directory == pathlib.Path(resume) else str(directory)


class ReusedBuffers(AsyncStager):
    """Stages a state dict for a background write by copying its tensors into CPU buffers kept from
    the save before (whose write has finished by then): copying into memory already touched is a few
    times faster than into fresh memory, and the step waits for the copy."""

    _synchronize_after_execute = False  # stage() has copied everything when it returns

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def stage(self, state_dict: dict) -> dict:
        return self._copy(state_dict, "")

    def _copy(self, value, key: str):
        if isinstance(value, DTensor):  # its piece copied; the global shape and placements kept
            return DTensor.from_local(self._copy(value.to_local(), key), value.device_mesh, value.placements,
                                      run_check=False, shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            buffer = self.buffers.get(key)
            if buffer is None or (buffer.shape, buffer.stride(), buffer.dtype) != (value.shape, value.stride(),
                                                                                   value.dtype):
                buffer = self.buffers[key] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
            return buffer.copy_(value)
        if isinstance(value, dict):
            return {k: self._copy(v, f"{key}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(v, f"{key}/{i}") for i, v in enumerate(value))
        return value  # numbers and text, which the state does not change in place

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class AsyncSaver:
    """Saves state dicts to ROOT/step-N: in the background (`asynchronous`), the previous save
    waited on first, or in the caller (the synchronous baseline). `group`: a gloo group of its own
    (the background write's collectives run beside the training step's), None in one process."""

    def __init__(self, root, *, keep: int | None = None, group=None, rank: int = 0, asynchronous: bool = True):
        self.root, self.keep, self.group, self.rank = pathlib.Path(root), keep, group, rank
        self.asynchronous, self.stager = asynchronous, ReusedBuffers()
        if not dist.is_initialized():  # dcp says so on every save, from the writing thread too: it is one process
            warnings.filterwarnings("ignore", category=UserWarning,
                                    message=r"torch.distributed is (disabled, )?unavailable or uninitialized")
        self.pending: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.blocked_seconds: list[float] = []  # how long each save held up its caller

    def save(self, state: dict, step: int) -> pathlib.Path:
        started = time.perf_counter()
        self.wait()
        directory = step_directory(self.root, step)
        if self.rank == 0:  # a step saved again (after a resume from an older one) is incomplete until rewritten
            directory.mkdir(parents=True, exist_ok=True)
            (directory / COMPLETE).unlink(missing_ok=True)
        one_process = not dist.is_initialized()
        if self.asynchronous:
            future = dcp.async_save(state, checkpoint_id=str(directory), process_group=self.group, no_dist=one_process,
                                    async_stager=self.stager)
            self.pending = threading.Thread(target=self._complete, args=(future, directory, step),
                                            name=f"picofx checkpoint {step}", daemon=True)
            self.pending.start()
        else:
            dcp.save(state, checkpoint_id=str(directory), process_group=self.group, no_dist=one_process)
            self._agree_and_mark(None, directory, step)
            self._raise_failure()
        self.blocked_seconds.append(time.perf_counter() - started)
        return directory

    def wait(self) -> None:
        """Until the save in flight (if any) is complete on every rank; raises if it failed."""
        if self.pending is not None:
            self.pending.join()
            self.pending = None
        self._raise_failure()

    def _complete(self, future, directory: pathlib.Path, step: int) -> None:
        error = None
        try:
            future.result()
        except BaseException as e:  # noqa: BLE001  (every rank still takes part in the agreement)
            error = e
        self._agree_and_mark(error, directory, step)

    def _agree_and_mark(self, error, directory: pathlib.Path, step: int) -> None:
        try:
            written = self._agree(error is None)
            if error is not None:
                raise error
            if not written:
                raise RuntimeError("another rank's write failed (its own error says why)")
            if self.rank != 0:  # no rank's save ends before the marker is written: a restart finds it on every rank
                if not self._agree(True):
                    raise RuntimeError(f"rank 0 could not write {COMPLETE} (its own error says why)")
                return
            marked = False
            try:
                (directory / COMPLETE).write_text(f"{step}\n")
                prune(self.root, self.keep)
                marked = True
            finally:
                self._agree(marked)
        except BaseException as e:  # noqa: BLE001  (raised in the training thread by wait())
            self.failure = RuntimeError(f"saving step {step} to {directory} failed on rank {self.rank}: {e}")
            self.failure.__cause__ = e  # a peer's death under the write is told as the collectives' are

    def _agree(self, mine: bool) -> bool:
        """Whether every rank of the saver's group says so (a collective there)."""
        flag = torch.tensor(int(mine))
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _raise_failure(self) -> None:
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure


class SecondInterrupt(KeyboardInterrupt):
    """A second Ctrl-C while the first one's checkpoint was awaited: the run aborts, unsaved."""


# what stopped a run, in the order agreement prefers: a Ctrl-C on any rank makes every rank exit 130
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """SIGTERM (what schedulers send before they stop a job) or Ctrl-C (SIGINT) sets a flag instead
    of ending the process; `agreed()` at a step boundary says which any rank got, so all stop at one
    step. A second Ctrl-C raises SecondInterrupt at once. `notice`: written to stderr at the first
    Ctrl-C (None: nothing), so that a long step does not look ignored."""

    def __init__(self, notice: str | None = None):
        self.requested: signal.Signals | None = None
        self.notice = notice
        self.previous: dict = {}

    def install(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self.previous = {s: signal.signal(s, self._request) for s in STOP_SIGNALS}
        return self

    def restore(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}

    def _request(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested == signal.SIGINT:
            self.restore()
            raise SecondInterrupt()
        if self.requested is None or signum == signal.SIGINT:
            self.requested = signal.Signals(signum)
        if signum == signal.SIGINT and self.notice:
            os.write(2, f"\n{self.notice}\n".encode())  # print() is not safe inside a signal handler

    def agreed(self) -> signal.Signals | None:
        """The signal any rank was stopped by (SIGINT over SIGTERM), or None (a collective on the
        default group: every rank calls it)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.requested
        mine = STOP_SIGNALS.index(self.requested) + 1 if self.requested is not None else 0
        flag = torch.tensor(mine)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return STOP_SIGNALS[int(flag.item()) - 1] if int(flag.item()) else None


def probe_writable(root, rank: int = 0) -> str | None:
    """Create `root` and write a file in it (removed again), so that a directory this process
    cannot write is found before any training: None when it can, else a one-line reason."""
    probe = pathlib.Path(root) / f".picofx-write-probe-{socket.gethostname()}-{os.getpid()}-rank{rank}"
    try:
        pathlib.Path(root).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"picofx checks that --save can be written\n")
        probe.unlink()
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(root) else ""
        return (f"--save {root}: cannot write there: {e.strerror or e}{where}; name a directory this user can "
                "create and write (checked before training, so nothing is lost)")
    return None
