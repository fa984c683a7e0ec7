"""What a training run's own numbers say to change: loss spikes, divergence and plateaus read from
the loss, learning rate and gradient norm of each step; the data wait and memory headroom; a rank
slower than the others and what made it slow. Pure functions over per-step records (the lines
`picofx train --metrics` writes), so `picofx train`'s summary and `picofx doctor` read a run alike.
"""
from picofx.diagnose.advice import diagnose, what_to_change
from picofx.diagnose.finding import Finding
from picofx.diagnose.records import StepLog, read_run
from picofx.diagnose.stragglers import gather_rank_figures

__all__ = ["Finding", "StepLog", "diagnose", "gather_rank_figures", "read_run", "what_to_change"]
