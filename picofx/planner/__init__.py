"""The planner: every layout of a training run over N GPUs predicted (picofx.planner.layouts, from one
decoder layer's costs read from the cost model: picofx.planner.costs) and ranked (picofx.planner.run),
each with its suggestions (picofx.planner.suggest); the one recipe from a layout to passes and mesh
(picofx.planner.recipe)."""
from picofx.planner.layouts import Layout, Prediction
from picofx.planner.recipe import Recipe
from picofx.planner.run import plan_run
from picofx.planner.suggest import Suggestion

__all__ = ["Layout", "Prediction", "Recipe", "Suggestion", "plan_run"]
