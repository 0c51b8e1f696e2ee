"""The ``deltarl`` command: one sub-command per service and tool.

Each sub-command lives next to the code it runs (``weightsync/cli.py`` for ``deltarl
delta``, ...). Those modules import only typer and settings at import time; heavy libraries (torch,
transformers, fastapi) are imported inside the command functions, after the arguments are parsed,
so that ``deltarl --help`` stays fast.

The core install is the light service stack; torch, numpy, numba and safetensors come with the
``weights`` extra, transformers with ``model``. A command that needs a missing extra ends with a
message naming it (:func:`main`), not a traceback.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from deltarl import __version__

# (sub-command name, module, attribute): the attribute is a ``typer.Typer`` (a group of commands)
# or a plain function (a single command).
SUBCOMMANDS: list[tuple[str, str, str]] = [
    ("delta", "deltarl.weightsync.cli", "app"),
    ("env", "deltarl.env_server.cli", "serve"),
    ("coordinator", "deltarl.services.coordinator.cli", "coordinator"),
    ("status", "deltarl.services.coordinator.cli", "status"),
    ("worker-token", "deltarl.services.coordinator.cli", "worker_token"),
    ("train", "deltarl.trainer.cli", "train"),
    ("sft", "deltarl.trainer.supervised.sft", "sft"),
    ("eval", "deltarl.eval.cli", "eval_wordle"),
    ("rollout", "deltarl.rollout.cli", "rollout"),
    ("teacher", "deltarl.teacher.cli", "teacher"),
    ("demo", "deltarl.demo.cli", "demo"),
    ("run", "deltarl.run.cli", "run"),
    ("spaces", "deltarl.spaces.cli", "app"),
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


def command_help(doc: str | None) -> str | None:
    """``doc`` with its first paragraph on one line: typer's rich help keeps a docstring's single
    line breaks, so a summary wrapped in the source came out ragged in ``deltarl --help``."""
    if doc is None:
        return None
    first, sep, rest = inspect.cleandoc(doc).partition("\n\n")
    return " ".join(first.split()) + sep + rest


# Services that take ``--run-config exp.toml``: the run config of ``deltarl run`` gives them their
# section and the [run] values they share (deltarl/run/services.py)
RUN_CONFIG_SERVICES = frozenset({"coordinator", "env", "rollout", "teacher", "train"})
RUN_CONFIG_HELP = (
    "A run config (the TOML of `deltarl run`): this service's section and the \\[run] values it "
    "shares, as `deltarl run` gives them; deployment (URLs, tokens, ports) still comes from the "
    "environment and the options."
)


def with_run_config(service: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with a ``--run-config`` option that sets the service's settings from a run
    config before it runs."""
    option = inspect.Parameter(
        "run_config",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(None, "--run-config", help=RUN_CONFIG_HELP),
        annotation=Path | None,
    )

    @functools.wraps(func)
    def command(*args: Any, run_config: Path | None = None, **kwargs: Any) -> Any:
        if run_config is not None:
            from deltarl.run.config import RunConfigError
            from deltarl.run.services import start_service

            try:
                start_service(service, run_config, kwargs)
            except RunConfigError as err:
                raise typer.BadParameter(str(err), param_hint="--run-config") from None
        return func(*args, **kwargs)

    signature = inspect.signature(func)
    command.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), option]
    )
    command.__annotations__ = {**func.__annotations__, "run_config": Path | None}
    return command


def _register() -> None:
    for name, module, attr in SUBCOMMANDS:
        obj = getattr(importlib.import_module(module), attr)
        if isinstance(obj, typer.Typer):
            app.add_typer(obj, name=name)
            continue
        if name in RUN_CONFIG_SERVICES:
            obj = with_run_config(name, obj)
        app.command(name=name, help=command_help(obj.__doc__))(obj)


_register()

# Top-level module -> the extra that installs it (pyproject.toml). The core install is the light
# service stack (coordinator, env server, status); these come with extras.
EXTRAS: dict[str, str] = {
    "torch": "weights",
    "numpy": "weights",
    "numba": "weights",
    "safetensors": "weights",
    "transformers": "model",
    "gguf": "model",
    "accelerate": "model",
    "boto3": "s3",
    "botocore": "s3",
    "redis": "redis",
}
# Commands whose whole stack is an extra: recommend it rather than the missing module's own (the
# trainer and the rollout worker need transformers as well as torch).
COMMAND_EXTRAS: dict[str, str] = {
    "train": "model",
    "sft": "model",
    "eval": "model",
    "rollout": "model",
    "teacher": "model",
    "demo": "model",
    "run": "model",
}


def missing_extra_message(exc: ModuleNotFoundError) -> str | None:
    """What to install when ``exc`` is a module of one of deltarl's extras; None otherwise."""
    top = (exc.name or "").partition(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    names = {name for name, _, _ in SUBCOMMANDS}
    command = next((a for a in sys.argv[1:] if a in names), None)
    if command in COMMAND_EXTRAS and extra in ("weights", "model"):
        extra = COMMAND_EXTRAS[command]
    return (
        f"{'deltarl ' + command if command else 'deltarl'} needs the Python package '{top}' "
        f"(the '{extra}' extra): pip install 'deltarl[{extra}]', or 'deltarl[all]' for every "
        "service"
    )


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as exc:
        message = missing_extra_message(exc)
        if message is None:
            raise
        typer.echo(f"Error: {message}", err=True)
        raise SystemExit(1) from exc
