"""Choose how each fused pattern runs by timing the candidates on the device.

For a pattern the candidates are picofx's Triton kernel ("kernel"), the fused op's decomposition that
Inductor fuses with its neighbours ("decomposed"), and the unfused ops as torch.compile sees them
("unfused"). Each is timed forward and backward on the graph's own shapes; the fastest is kept. A
pattern whose every candidate fails runs unfused, with a warning naming it.

The choice is timed once: it is cached in `<cache directory>/kernel_choice/<key>.json`, keyed by the
device (its name and compute capability), the torch and triton versions and every pattern's shapes;
an entry is used only when what it records of all these equals the current run's. Under torchrun
rank 0 decides (from its cache, or by timing) and broadcasts, so every rank runs the same graph.
"""
from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

CANDIDATES = ("kernel", "decomposed", "unfused")
# A timer: (pattern, candidate, run) -> seconds per forward + backward; `run` does one of them.
Timer = Callable[[str, str, Callable[[], None]], float]


@dataclass(frozen=True)
class Choice:
    chosen: str                                        # one of CANDIDATES
    times: dict = field(default_factory=dict)          # candidate -> seconds, or "failed: why"
    cached: bool = False

    def describe(self) -> str:
        times = ", ".join(f"{name} {t * 1e3:.3f} ms" if isinstance(t, float) else f"{name} {t}"
                          for name, t in self.times.items())
        return f"{self.chosen} ({times})" + (", cached" if self.cached else "")


def environment(device: torch.device) -> dict:
    """What a timing depends on besides the shapes: the device, torch and triton."""
    if device.type == "cuda":
        name = f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    else:
        name = f"{device.type} {platform.machine()} {platform.processor()}".strip()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": name, "torch": torch.__version__, "triton": triton_version}


def time_on_device(device: torch.device, repeats: int = 5) -> Timer:
    """Median wall time of `repeats` runs after one that compiles and warms up."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timer(pattern: str, candidate: str, run: Callable[[], None]) -> float:
        run()
        times = []
        for _ in range(repeats):
            synchronize()
            start = time.perf_counter()
            run()
            synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return timer


def measure(pattern: str, candidates: Mapping[str, Callable[[], None]], timer: Timer, where: str) -> Choice:
    """Time each candidate; the fastest, or "unfused" with a warning when every one failed."""
    times: dict = {}
    for name, run in candidates.items():
        try:
            times[name] = float(timer(pattern, name, run))
        except Exception as e:  # noqa: BLE001  a candidate that cannot run on this device is not chosen
            times[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    timed = {name: t for name, t in times.items() if isinstance(t, float)}
    if not timed:
        warnings.warn(f"fuse: every candidate for pattern {pattern!r} failed on {where} "
                      f"({'; '.join(f'{n}: {t}' for n, t in times.items())}); it runs as the unfused ops",
                      stacklevel=2)
        return Choice("unfused", times)
    return Choice(min(timed, key=timed.get), times)


class ChoiceCache:
    """The chosen candidates on disk, one JSON file per key."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory) / "kernel_choice"

    @staticmethod
    def key(env: dict, shapes: Mapping[str, list]) -> str:
        return hashlib.sha256(json.dumps([env, sorted(shapes.items())], default=str).encode()).hexdigest()[:32]

    def load(self, env: dict, shapes: Mapping[str, list]) -> dict[str, Choice] | None:
        try:
            stored = json.loads((self.directory / f"{self.key(env, shapes)}.json").read_text())
        except (OSError, ValueError):
            return None
        if stored.get("environment") != env or stored.get("shapes") != json.loads(json.dumps(shapes, default=str)):
            return None  # another device or version (or a corrupted entry): never used
        return {p: Choice(c["chosen"], c["times"], cached=True) for p, c in stored["choices"].items()}

    def save(self, env: dict, shapes: Mapping[str, list], choices: Mapping[str, Choice]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        entry = {"environment": env, "shapes": shapes,
                 "choices": {p: {"chosen": c.chosen, "times": c.times} for p, c in choices.items()}}
        path = self.directory / f"{self.key(env, shapes)}.json"
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(entry, default=str, indent=1))
        temporary.replace(path)


def from_rank0(decide: Callable[[], dict]):
    """`decide()` on rank 0, its result on every rank (one process: just `decide()`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decide()
    box = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def choose(patterns: Mapping[str, Mapping[str, Callable[[], None]]], shapes: Mapping[str, list], *,
           device: torch.device, directory: str | Path | None, timer: Timer | None = None,
           broadcast: Callable[[Callable[[], dict]], dict] = from_rank0) -> dict[str, Choice]:
    """pattern -> its Choice. `patterns`: pattern -> candidate -> a function running one forward and
    backward of it (compiling on its first call); `shapes`: pattern -> a description of the shapes it
    is timed at (part of the cache key). The cache is read and written on rank 0 only."""
    timer = timer or time_on_device(device)

    def decide() -> dict:
        env = environment(device)
        cache = ChoiceCache(directory) if directory else None
        cached = cache.load(env, shapes) if cache else None
        if cached is not None and set(cached) == set(patterns):
            return {p: asdict(c) for p, c in cached.items()}
        choices = {p: measure(p, candidates, timer, env["device"]) for p, candidates in patterns.items()}
        if cache:
            try:
                cache.save(env, shapes, choices)
            except OSError as e:  # the other ranks wait for this one's choice: a cache it cannot write is not fatal
                warnings.warn(f"fuse: the kernel choice could not be cached in {cache.directory}: {e}", stacklevel=2)
        return {p: asdict(c) for p, c in choices.items()}

    return {p: Choice(**c) for p, c in broadcast(decide).items()}
