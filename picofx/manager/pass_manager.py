"""The manager that orders the passes, runs them stage by stage, measures them and rolls them back.

The manager, not the pass, puts the passes in an order their declarations allow
(picofx.manager.order), measures time and node counts, re-annotates, verifies and restores the
previous graph when a pass fails.
"""
from __future__ import annotations

import copy
import time
import warnings

import torch
from torch import fx

from picofx.capture.annotate import annotate
from picofx.errors import BudgetError, PassBudgetError, PassError, VerificationError
from picofx.manager.order import run_order
from picofx.manager.passes import Context, PassRecord, PassResult, Stage, pass_info, pass_name, resolve_passes, runs_at
from picofx.manager.verify import check_invariants, check_numerics, check_structure


def _node_keys(graph: fx.Graph) -> dict[str, str]:
    return {n.name: f"{n.name} = {n.op} {getattr(n.target, '__name__', n.target)}" for n in graph.nodes}


def copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    with warnings.catch_warnings():  # copying a pytree spec's leaves trips torch's LeafSpec deprecation
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning)
        new._codegen = copy.deepcopy(graph._codegen)  # joint graphs take (primals, tangents) as pytrees
    new.output(new.graph_copy(graph, {}))
    return new


NOT_COMPARED = ("not compared: this rank's graph computes its part of a distributed step (averaged gradients, "
                "its pieces of the parameters), which the graph before the pass cannot equal on one rank; the "
                "distributed tests compare the ranks with one process")


def takes_pieces(gm: fx.GraphModule, inputs: list) -> bool:
    """The graph's inputs are this rank's pieces of the whole values the example inputs hold."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return any(isinstance(x, torch.Tensor) and isinstance(n.meta.get("val"), torch.Tensor)
               and n.meta["val"].shape != x.shape for n, x in zip(placeholders, inputs))


class Snapshot:
    """A graph module as it was before a pass: its graph (a copy) and its own attributes. Restoring
    replaces the module's graph wholesale, so whatever state the pass left its nodes in (a cycle,
    nodes erased under their users, arguments from another graph) is never touched again."""

    def __init__(self, gm: fx.GraphModule):
        self.graph = copy_graph(gm.graph)
        self.attributes = (dict(gm._parameters), dict(gm._buffers), dict(gm._modules))

    def restore(self, gm: fx.GraphModule) -> None:
        for own, saved in zip((gm._parameters, gm._buffers, gm._modules), self.attributes):
            own.clear()
            own.update(saved)
        gm.graph = copy_graph(self.graph)  # also recompiles; a copy, so the snapshot serves again


class TagSnapshot:
    """Before a pass that declares it only writes node.meta (PassInfo.tags_only): every node's meta
    and the graph's wiring, instead of a copy of a graph that may hold thousands of nodes."""

    def __init__(self, gm: fx.GraphModule):
        self.meta = {node: dict(node.meta) for node in gm.graph.nodes}
        self.wiring = self.wiring_of(gm.graph)

    @staticmethod
    def wiring_of(graph: fx.Graph) -> list:
        return [(node, node.op, node.target, node.args, node.kwargs) for node in graph.nodes]

    @property
    def graph(self) -> fx.Graph:  # the wiring is unchanged (checked), so the graph as it is
        return next(iter(self.meta)).graph

    def check(self, gm: fx.GraphModule) -> None:
        if self.wiring_of(gm.graph) != self.wiring:
            raise VerificationError("it declares PassInfo(tags_only=True) but changed the graph's nodes or edges")

    def restore(self, gm: fx.GraphModule) -> None:
        for node, meta in self.meta.items():
            node.meta.clear()
            node.meta.update(meta)


class PassManager:
    def __init__(self, passes, *, verify: str | None = "invariants", instruments=()):
        if verify not in (None, "invariants", "numerics"):
            raise ValueError(f"verify must be None, 'invariants' or 'numerics', got {verify!r}")
        # the order they run in, and when it is not the order given, what moved and why (for the report)
        self.passes, self.order_changes = run_order(resolve_passes(passes))
        self.verify = verify
        self.instruments = list(instruments)
        self.records: list[PassRecord] = []

    def passes_at(self, stage: Stage) -> list:
        return [p for p in self.passes if runs_at(p, stage)]

    def declared(self, flag: str) -> list:
        """The passes whose PassInfo sets `flag` ("communicates", "measures", ...)."""
        return [p for p in self.passes if getattr(pass_info(p), flag)]

    def announce(self, label: str, gm: fx.GraphModule, ctx: Context) -> None:
        for instrument in self.instruments:
            instrument.on_graph(label, gm, ctx)

    def run(self, stage: Stage, gm: fx.GraphModule, ctx: Context) -> list[fx.GraphModule]:
        """Run this stage's passes over `gm`; returns the graphs that come out (one, unless split)."""
        graphs = [gm]
        for p in self.passes_at(stage):
            graphs = [out for g in graphs for out in self.run_one(p, g, ctx)]
        return graphs

    def run_one(self, p, gm: fx.GraphModule, ctx: Context) -> list[fx.GraphModule]:
        name = pass_name(p)
        tags_only = pass_info(p).tags_only
        snapshot = TagSnapshot(gm) if tags_only else Snapshot(gm)
        before_keys = _node_keys(gm.graph)
        start = time.perf_counter()
        returned = False
        try:
            result = p(gm, ctx)
            seconds = time.perf_counter() - start
            returned = True
            outputs = self.checked_outputs(p, result, gm, snapshot, ctx)
        except BaseException as e:
            snapshot.restore(gm)
            if not isinstance(e, Exception):  # KeyboardInterrupt and the like: the graph is whole again
                raise
            what = ("raised" if not returned else "failed verification" if isinstance(e, VerificationError)
                    else "returned a graph that failed checking")
            message = (f"pass '{name}' ({ctx.stage.value} stage, {ctx.graph_role} graph) {what}: "
                       f"{type(e).__name__}: {e}\n  the graph is left as it was before '{name}'.")
            if isinstance(e, BudgetError):  # still caught by `except picofx.BudgetError`
                raise PassBudgetError(message, e.smallest_peak, e.batch_that_fits) from e
            raise PassError(message) from e
        after_keys = {k: v for out in outputs for k, v in _node_keys(out.graph).items()}
        record = PassRecord(
            name=name, stage=ctx.stage, graph_role=ctx.graph_role, seconds=seconds,
            nodes_before=len(before_keys), nodes_after=len(after_keys),
            added=[v for k, v in after_keys.items() if before_keys.get(k) != v],
            removed=[v for k, v in before_keys.items() if after_keys.get(k) != v],
            changed=result.changed, notes=dict(result.notes))
        self.records.append(record)
        for instrument in self.instruments:
            instrument.after_pass(record, outputs[0], ctx)
        return outputs

    def checked_outputs(self, p, result, gm: fx.GraphModule, snapshot, ctx: Context) -> list[fx.GraphModule]:
        """The graphs a pass returned, each checked (structure first: torch's own checks and
        recompilation fail obscurely on a cycle or a dangling node), re-annotated and verified."""
        if not isinstance(result, PassResult):
            raise VerificationError(f"it returned {type(result).__name__}; a pass returns PassResult(changed, notes)")
        if result.graphs is not None and not pass_info(p).splits_graph:
            raise VerificationError("it returned several graphs (PassResult.graphs) without declaring "
                                    "PassInfo(splits_graph=True)")
        outputs = result.graphs or [gm]
        if isinstance(snapshot, TagSnapshot):  # nodes and edges as they were: no re-annotation
            snapshot.check(gm)
            outputs = []
        for out in outputs:
            check_structure(out.graph)
            out.graph.lint()
            out.recompile()
            annotate(out)
            check_invariants(out, ctx)
        if self.verify == "numerics" and ctx.example_inputs is not None and result.graphs is None:
            if pass_info(p).communicates or takes_pieces(gm, ctx.example_inputs):
                result.notes["numerics"] = NOT_COMPARED
            else:
                before = fx.GraphModule(gm, copy_graph(snapshot.graph))
                check_numerics(before, gm, ctx, result.tolerance, normwise=result.normwise)
        return outputs or [gm]
