"""Coordinator restart with the Redis store (SQLite: test_process_faults.py).

A deployment whose coordinator keeps its state in a redis-server (AOF, fsync always), with the
trainer and one rollout worker as processes: the coordinator is killed with ``kill -9`` and
started again on the same port; the run continues and every accepted group is still there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from coordinator.conftest import RedisServer
from faults.harness import TRAINER_OUTAGE_BUG, Cluster, FaultReport, assert_nothing_lost

pytestmark = [pytest.mark.network, pytest.mark.slow]


@pytest.fixture(scope="module")
def redis_cluster(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, fault_redis: RedisServer
) -> Iterator[Cluster]:
    c = Cluster(
        tmp_path_factory.mktemp("faults-redis"),
        model_dir,
        store="redis",
        redis_url=fault_redis.url,
        redis_prefix="faults1",
    )
    try:
        c.start_coordinator()
        c.start_env()
        c.start_trainer()
        c.start_worker("r1")
        c.wait_verified("r1", timeout=90)
        yield c
    finally:
        c.close()


def test_coordinator_restart_redis(redis_cluster: Cluster, fault_report: FaultReport) -> None:
    c = redis_cluster
    assert c.coordinator is not None
    c.wait_accepted(1, timeout=60)
    v_before = c.latest()
    assert v_before is not None
    before_kill, restored = c.restart_coordinator()
    assert restored.accepted == before_kill.accepted, (before_kill, restored)
    assert restored.acked >= before_kill.acked, (before_kill, restored)
    assert c.client.get_version(v_before).version == v_before  # versions survived too
    # the run continues: a new version, new groups, the worker follows and proves its weights
    v_restart = c.latest()  # the trainer may have published since v_before
    assert v_restart is not None and v_restart >= v_before
    trainer_died = c.wait_progress_after_restart(v_restart)
    c.wait_accepted(restored.accepted + 1, timeout=90)
    c.wait_verified("r1", timeout=60)
    values = c.losses(before_kill) | {
        "fault": "kill -9 coordinator (redis), restart",
        "accepted_before": before_kill.accepted,
        "accepted_after_restart": restored.accepted,
        "version_before": v_before,
        "version_after": c.latest(),
        "trainer_died_of_the_restart": trainer_died,
    }
    assert_nothing_lost(fault_report, "coordinator_restart_redis", values)
    if trainer_died:
        pytest.fail(f"{TRAINER_OUTAGE_BUG}: {trainer_died}")
