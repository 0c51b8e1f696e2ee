"""``deltarl coordinator`` (run the service), ``deltarl status URL`` (summary in a terminal) and
``deltarl worker-token ID`` (a worker's own token, for per-worker credentials).

Only typer and the settings class are imported here; uvicorn, fastapi and the app are imported
inside the command, after the arguments are parsed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import typer
from pydantic import ValidationError

from deltarl.services.common.settings import settings_help
from deltarl.services.coordinator.settings import CoordinatorSettings

logger = logging.getLogger(__name__)


def coordinator(
    host: str | None = typer.Option(None, "--host", help="Interface (overrides the setting)."),
    port: int | None = typer.Option(None, "--port", help="TCP port (overrides the setting)."),
    workers: int | None = typer.Option(
        None, "--workers", help="Server processes (overrides the setting)."
    ),
) -> None:
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if workers is not None:
        overrides["workers"] = workers
    try:
        settings = CoordinatorSettings(**overrides)
    except ValidationError as exc:
        messages = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise typer.BadParameter(messages) from exc

    import uvicorn

    from deltarl.services.coordinator.app import create_app

    logger.info(
        "coordinator on %s://%s:%d (store %s, %d process(es))",
        settings.scheme,
        settings.host,
        settings.port,
        settings.store,
        settings.workers,
    )
    common: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
        "access_log": False,
        "timeout_graceful_shutdown": 5,
        **settings.uvicorn_tls(),
    }
    if settings.workers == 1:
        uvicorn.run(create_app(settings), **common)
        return
    if settings.store == "sqlite" and settings.sqlite_path == ":memory:":
        raise typer.BadParameter("several workers cannot share an in-memory SQLite store")
    # worker processes build their own app from the environment: pass the CLI overrides on
    os.environ["DELTARL_COORDINATOR_HOST"] = settings.host
    os.environ["DELTARL_COORDINATOR_PORT"] = str(settings.port)
    uvicorn.run(
        "deltarl.services.coordinator.app:app_from_env",
        factory=True,
        workers=settings.workers,
        **common,
    )


coordinator.__doc__ = (
    "Run the coordinator service (versions, workers, trajectory queue, status page).\n\n"
    + "\b\n"
    + settings_help(CoordinatorSettings)
)


def status(
    url: str = typer.Argument(..., help="Coordinator base URL, e.g. http://127.0.0.1:8700"),
    token: str | None = typer.Option(
        None,
        "--token",
        envvar="DELTARL_COORDINATOR_TOKEN",
        help="Token, if reads are not public (env DELTARL_COORDINATOR_TOKEN).",
    ),
    workers: int = typer.Option(20, "--workers", help="Workers to list (laggiest first)."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON summary."),
) -> None:
    """Print where a run stands: versions, queue, staleness, workers."""
    from rich.console import Console

    from deltarl.services.coordinator.client import CoordinatorClient, CoordinatorError
    from deltarl.services.coordinator.status_view import render_status

    logging.getLogger("httpx").setLevel(logging.WARNING)

    try:
        # a one-shot probe: say at once that nothing answers (no waiting for a restart)
        with CoordinatorClient(
            url, token or os.environ.get("DELTARL_TOKEN"), refused_wait_s=0.0
        ) as client:
            summary = client.status(workers=workers)
    except CoordinatorError as exc:
        raise typer.BadParameter(f"{url}: {exc}") from exc
    except Exception as exc:  # connection refused, DNS, timeout: say so plainly
        raise typer.BadParameter(f"cannot reach {url}: {exc}") from exc
    console = Console()
    if as_json:
        console.print_json(summary.model_dump_json())
    else:
        console.print(render_status(summary, url))


def worker_token(
    worker_id: str = typer.Argument(..., help="The worker's id (DELTARL_ROLLOUT_WORKER_ID)."),
    key: str | None = typer.Option(
        None,
        "--key",
        envvar="DELTARL_COORDINATOR_WORKER_KEY",
        help="The coordinator's worker key (env DELTARL_COORDINATOR_WORKER_KEY; prefer the "
        "variable: options show in process lists).",
        show_default=False,
    ),
) -> None:
    """Print the token of one worker under the coordinator's worker key (per-worker
    credentials): give it to that worker as DELTARL_ROLLOUT_COORDINATOR_TOKEN."""
    import re

    from deltarl.services.common.settings import validate_token
    from deltarl.services.coordinator.auth import worker_token_for
    from deltarl.services.coordinator.schemas.common import ID_PATTERN

    if re.fullmatch(ID_PATTERN, worker_id) is None:
        raise typer.BadParameter(
            "a worker id is 1 to 128 letters, digits or ._:@- starting with a letter or digit",
            param_hint="WORKER_ID",
        )
    try:
        secret = validate_token(key, "DELTARL_COORDINATOR_WORKER_KEY")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--key") from exc
    if secret is None:
        raise typer.BadParameter(
            "set DELTARL_COORDINATOR_WORKER_KEY (the coordinator's worker key)", param_hint="--key"
        )
    typer.echo(worker_token_for(secret, worker_id))
