"""Test-only hold points, so that a fault test can kill a worker at an exact place.

Nothing happens unless the environment variable ``DELTARL_TEST_FAULT_DIR`` names a directory
(read once, at import); never set it in a deployment. A test *arms* point ``P`` by creating
``<dir>/P.hold``; the next time the worker reaches ``P`` it writes ``<dir>/P.reached`` (a JSON
object: the point's details and the process id) and blocks until ``P.hold`` is removed. The
test waits for ``P.reached`` and then kills the process (``kill -9``), so the fault lands
exactly in the window it wants, with no timing guess.

Points (see the call sites):

* ``before_apply`` (:meth:`deltarl.rollout.sync.weights.WeightSync._apply_delta`): a delta was
  downloaded, checked and decoded, its apply has not started (between download and apply);
* ``mid_episode`` (:meth:`deltarl.rollout.episodes.runner.EpisodeRunner._play`): a reply was sampled,
  the environment has not seen it yet (an episode with an open env session and sampled tokens).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["ENV_VAR", "armed", "hold"]

ENV_VAR = "DELTARL_TEST_FAULT_DIR"
_DIR = os.environ.get(ENV_VAR) or None


def armed(point: str) -> bool:
    """Whether a test armed ``point`` (always False without ``DELTARL_TEST_FAULT_DIR``)."""
    return _DIR is not None and (Path(_DIR) / f"{point}.hold").exists()


def hold(point: str, **details: object) -> None:
    """If ``point`` is armed: report that it was reached, then block until it is disarmed."""
    if not armed(point):
        return
    assert _DIR is not None
    d = Path(_DIR)
    tmp = d / f".{point}.reached.tmp"
    tmp.write_text(json.dumps({"point": point, "pid": os.getpid(), **details}, default=str))
    os.replace(tmp, d / f"{point}.reached")
    while (d / f"{point}.hold").exists():
        time.sleep(0.01)
