"""A run's per-step records: kept during the run (the first steps and a window of the latest, so a
long run's memory stays bounded) and read back from a --metrics file or a --save directory."""
from __future__ import annotations

import collections
import json
import pathlib

METRICS_NAME = "metrics.jsonl"  # picofx train's per-step records inside its --save directory


class StepLog:
    """The records a run's summary reads: the first `first` steps and the latest `latest`, each with
    the run's own figures (`run`: batch, data workers, device) as a --metrics line has them."""

    def __init__(self, first: int = 100, latest: int = 2000, run: dict | None = None):
        self.run = run or {}
        self.head: list[dict] = []
        self.tail: collections.deque = collections.deque(maxlen=latest)
        self.first = first

    def add(self, record: dict) -> None:
        (self.head if len(self.head) < self.first else self.tail).append({**self.run, **record})

    @property
    def records(self) -> list[dict]:
        return [*self.head, *self.tail]


def metrics_file(path: str | pathlib.Path) -> pathlib.Path:
    """The records' file: `path` itself, or the metrics.jsonl of a --save directory."""
    path = pathlib.Path(path)
    if path.is_dir():
        found = path / METRICS_NAME
        if not found.is_file():
            raise FileNotFoundError(f"{path}: a directory without {METRICS_NAME}; give the run's --metrics file, or a "
                                    f"--save directory of a run that wrote its records there")
        return found
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file or directory; give a --metrics file or a --save directory")
    return path


def read_run(path: str | pathlib.Path) -> list[dict]:
    """The records of a --metrics file or --save directory, one per step, sorted by step. A resumed
    run appends: a step logged twice (run again after the last checkpoint) keeps its latest line."""
    by_step: dict[int, dict] = {}
    source = metrics_file(path)
    lines = source.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # a run stopped mid-write
                continue
            raise ValueError(f"{source}:{number}: not a JSON line; is this a --metrics file?") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{source}:{number}: a line without a step; is this a --metrics file?")
        by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]
