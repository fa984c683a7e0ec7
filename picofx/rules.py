"""The rule API under its public name: `from picofx.rules import Rule, register_rule, tensor, scalar`."""
from picofx.rewrite.matcher import Match
from picofx.rewrite.rules import Rule, RuleError, register_rule, registered_rules, scalar, tensor, unregister_rule

__all__ = ["Match", "Rule", "RuleError", "register_rule", "registered_rules", "scalar", "tensor", "unregister_rule"]
