"""The test helper that spawns process-group ranks (tests/ranks.py) reports how a rank died."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ranks import spawn_ranks


def abort_on_rank1(rank: int, root: str) -> None:
    if rank == 1:
        os.abort()  # what gloo does when a connection fails under it


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_leaves_its_python_stack(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as err:
        spawn_ranks(abort_on_rank1, tmp_path, 2)
    text = str(err.value)
    assert "SIGABRT" in text and "--- rank 1 ---" in text and "--- rank 0 ---" not in text
    assert "abort_on_rank1" in text  # the frame it died in


@pytest.mark.slow
def test_ranks_that_finish_raise_nothing(tmp_path: Path) -> None:
    spawn_ranks(abort_on_rank1, tmp_path, 1)
    assert (tmp_path / "fault-rank0.txt").read_text() == ""
