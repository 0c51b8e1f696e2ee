"""``python -m deltarl.env_server [--host H] [--port P]``: same as ``deltarl env``."""

import typer

from .cli import serve

if __name__ == "__main__":
    typer.run(serve)
