"""`picofx plan`: the layouts of a training run over N GPUs, predicted and ranked (picofx.planner.layouts),
from one decoder layer's costs read from the cost model (picofx.planner.costs)."""
from picofx.cli.plan import add_plan_parser, plan_command, plan_run

__all__ = ["add_plan_parser", "plan_command", "plan_run"]
