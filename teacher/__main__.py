"""``python -m deltarl.teacher [--host H] [--port P]``: same as ``deltarl teacher``."""

import logging
import os

import typer

from deltarl.teacher.cli import teacher

if __name__ == "__main__":
    logging.basicConfig(
        level=os.environ.get("DELTARL_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    typer.run(teacher)
