"""The test-only hold points of the rollout worker (rollout/fault_points.py), in process."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from faults.harness import arm, disarm, reached, wait_for

from deltarl.rollout import fault_points


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


def test_the_auditors_count_what_is_wrong(tmp_path: Path) -> None:
    """The counts the scenarios assert to be zero do become non-zero on a bad run."""
    import subprocess

    from faults.harness import Cluster, Ledger, sync_lines, verified_versions

    from deltarl.cluster import Child

    assert Ledger(5, 2, 1, 1, {}, 0).lost == 1  # one accepted group is nowhere
    assert Ledger(4, 2, 1, 1, {}, 3).lost == 0
    log = tmp_path / "w.1.log"
    log.write_text(
        "x INFO deltarl.rollout.sync.weights: weights at v0 via anchor (100 bytes): paused 1 ms\n"
        "x INFO deltarl.rollout.sync.weights: weights at v2 via delta (10 bytes): paused 1 ms\n"
        "x INFO deltarl.rollout.sync.weights: sync vNone -> v2: planned 110 bytes, downloaded 120 "
        "bytes, 1 failure(s)\n"
    )
    assert verified_versions([log]) == {0, 2}
    assert sync_lines(log) == [
        {"from": None, "to": 2, "planned": 110, "downloaded": 120, "failures": 1}
    ]
    c = Cluster(tmp_path / "c", tmp_path)
    proc = subprocess.Popen(["true"])
    proc.wait()
    c.workers["w"] = Child("w.1", proc, log)
    c.group.children.append(c.workers["w"])
    rows = [("w", "g1", 0, 2), ("w", "g2", 1, 2), ("other", "g3", 0, 0)]
    # v1 was never verified by w; "other" has no log at all
    assert c.unverified(rows) == [("w", "g2", 1, 2), ("other", "g3", 0, 0)]
    c.client.close()


def test_a_trainer_killed_by_a_coordinator_restart_is_recognised(tmp_path: Path) -> None:
    """A trainer killed by a transport error out of pull_groups (the old bug) is told apart from any
    other trainer exit, which must fail the scenario instead."""
    import subprocess

    from faults.harness import Cluster

    from deltarl.cluster import Child

    c = Cluster(tmp_path / "c", tmp_path)
    proc = subprocess.Popen(["false"])
    proc.wait()
    log = tmp_path / "trainer.1.log"
    c.trainer = Child("trainer.1", proc, log)
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "/x/deltarl/trainer/loop.py", line 131, in pull_groups\n'
        "    leased = source.lease(want - len(out.groups), settings.lease_s, poll_s)\n"
        "httpx.RemoteProtocolError: Server disconnected without sending a response.\n"
    )
    why = c.trainer_outage_death()
    assert why is not None and "RemoteProtocolError" in why and "loop.py" in why
    assert c.trainer_outage_death() is None  # reported once, then ended on purpose
    c.trainer = Child("trainer.2", proc, log)
    log.write_text("Traceback (most recent call last):\nValueError: something else\n")
    assert c.trainer_outage_death() is None
    c.client.close()
