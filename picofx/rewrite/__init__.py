"""The rule API: rules as (pattern, replacement) functions traced to ATen, the matcher that finds
them in a graph, and the rewriter that replaces the matches."""
from picofx.rewrite.rules import Rule, RuleError, register_rule, registered_rules, scalar, tensor, unregister_rule

__all__ = ["Rule", "RuleError", "register_rule", "registered_rules", "scalar", "tensor", "unregister_rule"]
