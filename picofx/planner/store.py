"""Captured steps kept on disk, so that a second `picofx plan` (or `picofx.plan`) of the same model
and sequence reads its two captures (one decoder layer and two) instead of capturing again: the
captures are nearly all of a plan's time (llama2-7b at 4096 tokens: about 20 of 30 s on 2 cores).

An entry's key covers what a capture depends on: the capture's own key (the model's shape, layers,
sequence, batch, passes, the cost model's options), picofx's source files, the versions of torch
and Python, and what the scratch memory measured on this machine depends on (its CPU's vector
instructions, torch's thread count). Entries live beside the graph cache's (PICOFX_CACHE_DIR, else
~/.cache/picofx) as `<key>.capture`; PICOFX_CACHE=0 turns the store off, as it turns that cache off.
An unreadable entry is captured again and rewritten.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import platform
import sys
from pathlib import Path

import torch

FORMAT = 1


class CaptureStore:
    """Entries `<key>.capture` in `directory`; `load` answers None for anything it cannot use."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._versions: str | None = None

    @classmethod
    def from_environment(cls) -> CaptureStore | None:
        """The store in the graph cache's directory, or None where PICOFX_CACHE=0."""
        if os.environ.get("PICOFX_CACHE", "1") == "0":
            return None
        from picofx.runtime.cache import default_directory

        return cls(os.environ.get("PICOFX_CACHE_DIR") or default_directory())

    def versions(self) -> str:
        """A digest of picofx's source files and of the machine facts a capture's scratch memory reads."""
        if self._versions is None:
            digest = hashlib.sha256()
            root = Path(__file__).resolve().parents[1]
            for path in sorted(root.rglob("*.py")):
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
            digest.update(repr((FORMAT, torch.__version__, sys.version, platform.machine(),
                                torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())).encode())
            self._versions = digest.hexdigest()
        return self._versions

    def path(self, key: tuple) -> Path:
        name = hashlib.sha256((self.versions() + repr(key)).encode()).hexdigest()[:24]
        return self.directory / f"{name}.capture"

    def load(self, key: tuple):
        try:
            stored_key, captured = pickle.loads(self.path(key).read_bytes())
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, TypeError, ValueError):
            return None
        return captured if stored_key == repr(key) else None

    def save(self, key: tuple, captured) -> None:
        path = self.path(key)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial.write_bytes(pickle.dumps((repr(key), captured)))
            os.replace(partial, path)  # readers never see half an entry
        except OSError:  # a read-only or full cache directory: the plan goes on without it
            partial.unlink(missing_ok=True)
