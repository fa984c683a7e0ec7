"""Tests run with picofx's on-disk graph cache off (PICOFX_CACHE=0), so that each test captures
and runs its passes, and nothing is written to the user's cache directory; tests/test_cache.py
turns it on in a temporary directory of its own."""
import os

os.environ.setdefault("PICOFX_CACHE", "0")
