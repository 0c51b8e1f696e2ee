"""``python -m deltarl.env_server [--host H] [--port P]``: same as ``deltarl env``."""

import logging
import os

import typer

from deltarl.env_server.cli import serve

if __name__ == "__main__":
    logging.basicConfig(
        level=os.environ.get("DELTARL_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    typer.run(serve)
