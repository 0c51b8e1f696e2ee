"""``deltarl coordinator --host H --port P`` for the fault harness, with the tests' pacing:
/v1/status never cached (the audits compare it with the store), versions of other processes
polled every 0.1 s and expired leases reclaimed every 0.2 s. Settings come from the environment
(``DELTARL_COORDINATOR_*``) as for the real command; one process."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from deltarl.services.coordinator.app import create_app
from deltarl.services.coordinator.service import Pacing
from deltarl.services.coordinator.settings import CoordinatorSettings

PACING = Pacing(status_cache_s=0.0, event_poll_s=0.1, reclaim_interval_s=0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = CoordinatorSettings(host=a.host, port=a.port)
    uvicorn.run(
        create_app(settings, pacing=PACING),
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=5,
        **settings.uvicorn_tls(),
    )


if __name__ == "__main__":
    main()
