"""Where a tool writes its results: the file the user names (--json PATH), or a file in a fresh
temporary directory, printed; never the current directory or the checkout, and never a file
another run also writes."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path


def result_path(given: str | None, name: str) -> Path:
    """`given` (its folder created), or `name` in a new temporary directory."""
    if given:
        path = Path(given)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix="picofx-")) / name


def write_json(data, given: str | None, name: str) -> Path:
    """Write `data` as JSON where `result_path` says, and say where."""
    path = result_path(given, name)
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")
    return path
