"""picofx.parallel.launch.run_ranks: a rank that dies of a signal is named with it, and where the
test suite asks (PICOFX_RANK_CRASH_RETRIES) its group runs once more."""
import os
import signal

import pytest

from picofx.parallel.launch import CRASH_RETRIES_ENV, RankCrashed, run_ranks


def abort_the_first_time(rank: int, world: int, marker: str) -> int:
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGABRT)
    return 7


def test_a_rank_killed_by_a_signal_is_named_and_its_group_runs_once_more(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(CRASH_RETRIES_ENV, "0")
    with pytest.raises(RankCrashed, match="rank 0 died of SIGABRT"):
        run_ranks(abort_the_first_time, 1, str(tmp_path / "first"), timeout=120)
    monkeypatch.setenv(CRASH_RETRIES_ENV, "1")
    assert run_ranks(abort_the_first_time, 1, str(tmp_path / "second"), timeout=120) == [7]
    assert "rank 0 died of SIGABRT; running abort_the_first_time on 1 ranks once more" in capfd.readouterr().err
