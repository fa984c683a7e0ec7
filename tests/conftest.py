"""Tests run with picofx's on-disk graph cache off (PICOFX_CACHE=0), so that each test captures
and runs its passes, and nothing is written to the user's cache directory; tests/test_cache.py
turns it on in a temporary directory of its own."""
import os

os.environ.setdefault("PICOFX_CACHE", "0")
# A spawned group whose rank dies of a native crash (a signal) runs once more: picofx.parallel.launch.
os.environ.setdefault("PICOFX_RANK_CRASH_RETRIES", "1")

import importlib  # noqa: E402
import multiprocessing  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def import_tool():
    """`import_tool(name, *folders)`: the module tools/name.py, imported with tools/ (and `folders`)
    on the path while it imports."""
    def load(name: str, *folders):
        added = [str(ROOT / "tools"), *map(str, folders)]
        sys.path[:0] = added
        try:
            return importlib.import_module(name)
        finally:
            del sys.path[:len(added)]
    return load


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_tests():
    """A child still running when the tests end (a DataLoader worker, a rank) would keep the
    interpreter waiting at exit: it is killed here, and the session fails naming it."""
    yield
    left = multiprocessing.active_children()
    for child in left:
        child.kill()
        child.join(10)
    if left:
        pytest.fail(f"processes outlived the tests (killed): {[child.name for child in left]}")
