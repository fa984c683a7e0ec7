"""The tests' rank harness is picofx's own (picofx.parallel.launch): gloo ranks in spawned processes,
a hard timeout, every process it started killed at the end."""
from picofx.parallel.launch import RankError, free_port, run_ranks  # noqa: F401
