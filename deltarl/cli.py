"""The ``deltarl`` command: one sub-command per service and tool.

Each sub-command lives next to the code it runs (``services/weightsync/cli.py`` for ``deltarl
delta``, ...). Those modules import only typer and settings at import time; heavy libraries (torch,
transformers, fastapi) are imported inside the command functions, after the arguments are parsed,
so that ``deltarl --help`` stays fast.
"""

from __future__ import annotations

import importlib
import logging

import typer

from deltarl import __version__

# (sub-command name, module, attribute): the attribute is a ``typer.Typer`` (a group of commands)
# or a plain function (a single command).
SUBCOMMANDS: list[tuple[str, str, str]] = [
    ("delta", "deltarl.services.weightsync.cli", "app"),
    ("env", "deltarl.env_server.cli", "serve"),
    ("coordinator", "deltarl.services.coordinator.cli", "coordinator"),
    ("status", "deltarl.services.coordinator.cli", "status"),
    ("train", "deltarl.trainer.cli", "train"),
    ("rollout", "deltarl.rollout.cli", "rollout"),
]

app = typer.Typer(
    name="deltarl",
    help="Disaggregated asynchronous RL with lossless sparse weight deltas.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"deltarl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    log_level: str = typer.Option(
        "INFO", "--log-level", envvar="DELTARL_LOG_LEVEL", help="Python logging level."
    ),
) -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _register() -> None:
    for name, module, attr in SUBCOMMANDS:
        obj = getattr(importlib.import_module(module), attr)
        if isinstance(obj, typer.Typer):
            app.add_typer(obj, name=name)
        else:
            app.command(name=name)(obj)


_register()


def main() -> None:
    app()
