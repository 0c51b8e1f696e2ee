"""``python -m deltarl.services.coordinator`` is ``deltarl coordinator``."""

import logging
import os

import typer

from deltarl.services.coordinator.cli import coordinator

if __name__ == "__main__":
    logging.basicConfig(
        level=os.environ.get("DELTARL_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    typer.run(coordinator)
