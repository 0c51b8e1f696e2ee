"""The test-only hold points of the rollout worker (rollout/fault_points.py), in process."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from deltarl.rollout import fault_points
from tests.faults.harness import arm, disarm, reached, wait_for


def test_unset_or_unarmed_points_do_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fault_points, "_DIR", None)
    assert not fault_points.armed("before_apply")
    fault_points.hold("before_apply")  # returns at once
    monkeypatch.setattr(fault_points, "_DIR", str(tmp_path))
    assert not fault_points.armed("before_apply")
    fault_points.hold("before_apply")
    assert list(tmp_path.iterdir()) == []


def test_an_armed_point_reports_and_blocks_until_disarmed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fault_points, "_DIR", str(tmp_path))
    arm(tmp_path, "before_apply")
    assert fault_points.armed("before_apply") and not fault_points.armed("mid_episode")
    t = threading.Thread(target=fault_points.hold, args=("before_apply",), kwargs={"version": 7})
    t.start()
    info = wait_for(lambda: reached(tmp_path, "before_apply"), 10, "not reached")
    assert info["version"] == 7 and info["point"] == "before_apply"
    t.join(0.2)
    assert t.is_alive(), "hold() returned while the point was armed"
    disarm(tmp_path, "before_apply")
    t.join(5)
    assert not t.is_alive()
    assert json.loads(json.dumps(info))  # plain JSON
