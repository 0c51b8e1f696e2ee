"""``python -m deltarl.rollout`` is ``deltarl rollout``."""

import logging
import os

import typer

from deltarl.rollout.cli import rollout

if __name__ == "__main__":
    logging.basicConfig(
        level=os.environ.get("DELTARL_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    typer.run(rollout)
