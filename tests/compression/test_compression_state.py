"""picofx.compression.state: the codecs' typed state and the keys a DCP checkpoint saves it under."""
from __future__ import annotations

import torch

from picofx.compression import CompressionState


def filled(rank: int) -> CompressionState:
    state = CompressionState(rank)
    state.residuals.get("w", (2, 3), torch.float32, "cpu").fill_(1.0)
    state.residuals.get("shard_bucket0", (6,), torch.float32, "cpu").fill_(2.0)
    state.powersgd.get(4, "w", 8, torch.float32, "cpu").mul_(2.0)
    state.relative_errors.get("w", "cpu").fill_(0.25)
    return state


def test_each_ranks_own_tensors_are_saved_under_its_rank_and_powersgds_q_shared():
    state = filled(rank=1)
    assert set(state.state_dict()) == {"rank1/residual/w", "rank1/residual/shard_bucket0", "powersgd4/w",
                                       "rank1/error/w"}
    assert state.errors() == {"w": 0.25}
    assert state.powersgd.get(4, "w", 8, torch.float32, "cpu") is state.tensors["powersgd4/w"]  # made once


def test_reset_zeroes_residuals_and_errors_and_restarts_q():
    state = filled(rank=0)
    q = state.tensors["powersgd4/w"]
    assert not torch.equal(q, state.powersgd.first[(4, "w")])
    state.reset()
    assert all(v.abs().sum() == 0 for k, v in state.tensors.items() if not k.startswith("powersgd"))
    torch.testing.assert_close(q, state.powersgd.first[(4, "w")], rtol=0, atol=0)
    torch.testing.assert_close(q.T @ q, torch.eye(4))  # an orthonormal start


def test_load_state_dict_writes_in_place():
    saved = {k: v.clone() for k, v in filled(rank=1).state_dict().items()}
    state = filled(rank=1)
    kept = dict(state.tensors)
    state.reset()
    state.load_state_dict(saved)
    for key, value in state.state_dict().items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0)
    assert all(state.tensors[k] is v for k, v in kept.items())  # the graphs' buffers are these tensors


def test_q_shared_by_some_ranks_only_is_saved_under_them():
    """Beside tensor or pipeline parallelism the exchange's ranks are not the world, and other ranks
    hold other pieces under the same parameter names: Q's key names the ranks that share it."""
    state = CompressionState(3, replicas="ranks1_3")
    state.powersgd.get(4, "w", 8, torch.float32, "cpu")
    state.residuals.get("w", (2, 3), torch.float32, "cpu")
    assert set(state.state_dict()) == {"ranks1_3/powersgd4/w", "rank3/residual/w"}
    saved = {k: v + 1 for k, v in state.state_dict().items()}
    state.load_state_dict(saved)
    torch.testing.assert_close(state.tensors["powersgd4/w"], saved["ranks1_3/powersgd4/w"], rtol=0, atol=0)
