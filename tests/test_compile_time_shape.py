"""Compile time grows linearly with the number of layers: the work `fuse` does, counted (nodes the
structure matcher compares, values the rewriter propagates again), not timed, at 2 and 4 layers."""
import dataclasses

import pytest
import torch
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from picofx.capture.export import capture
from picofx.models.llama import CONFIGS, Llama, causal_lm_loss
from picofx.passes import Fuse
from picofx.rewrite import rewriter
from picofx.testing import op_counts


def fuse_work(layers: int) -> dict:
    config = dataclasses.replace(CONFIGS["tiny"], num_hidden_layers=layers)
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    gm = capture(Llama(config), {"input_ids": ids, "labels": ids}, causal_lm_loss)
    counts = {"compared": 0, "propagated": 0}
    compare, run_node = SubgraphMatcher._match_nodes, rewriter._ViewFixer.run_node

    def counted_compare(self, *args, **kwargs):
        counts["compared"] += 1
        return compare(self, *args, **kwargs)

    def counted_run(self, node):
        counts["propagated"] += 1
        return run_node(self, node)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SubgraphMatcher, "_match_nodes", counted_compare)
        patch.setattr(rewriter._ViewFixer, "run_node", counted_run)
        Fuse()(gm, None)
    counts["fused_ops"] = sum(n for op, n in op_counts(gm).items() if "picofx" in str(op))
    return counts


@pytest.mark.parametrize("work", ["compared", "propagated"])
def test_fuse_work_is_linear_in_layers(work):
    two, four = fuse_work(2), fuse_work(4)
    assert four["fused_ops"] > two["fused_ops"] > 0
    # per added layer, the same work again (the model's ends, embedding and loss, are counted in both)
    per_layer = (four[work] - two[work]) / 2
    assert four[work] <= 2 * two[work] + 1, (work, two, four)
    assert per_layer <= two[work], (work, two, four)


def checkpoint_work(layers: int) -> dict:
    """What `checkpoint` reads of the joint graph's nodes while it plans: storage facts (once per
    node for all its simulations, not once per simulation) and simulations run."""
    import picofx
    from picofx.cost import liveness
    from picofx.passes import Checkpoint
    from picofx.passes.checkpoint.checkpoint import Checkpoint as CheckpointPass

    config = dataclasses.replace(CONFIGS["tiny"], num_hidden_layers=layers)
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (4, 128))
    counts = {"storages_read": 0, "planning": False}
    read, plan = liveness.value_storages, CheckpointPass._plan

    def counted_read(node):
        counts["storages_read"] += counts["planning"]
        return read(node)

    def counted_plan(self, gm, ctx):
        counts["planning"], counts["joint_nodes"] = True, len(gm.graph.nodes)
        try:
            return plan(self, gm, ctx)
        finally:
            counts["planning"] = False

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PICOFX_CACHE", "0")
        patch.setattr(liveness, "value_storages", counted_read)
        patch.setattr(CheckpointPass, "_plan", counted_plan)
        opt = picofx.optimize(Llama(config), {"input_ids": ids, "labels": ids}, [Checkpoint(budget=0.9)],
                              backend="eager", loss_fn=causal_lm_loss, verify=None)
    counts["simulations"] = next(r for r in opt.report.records if r.name == "checkpoint").notes["simulations"]
    return counts


def test_checkpoint_work_is_linear_in_layers():
    two, four = checkpoint_work(2), checkpoint_work(4)
    assert two["simulations"] > 1
    for counts in (two, four):  # each node's storages read once, however many simulations
        assert counts["storages_read"] <= counts["joint_nodes"], counts
    assert four["simulations"] <= two["simulations"] + 2, (two, four)
