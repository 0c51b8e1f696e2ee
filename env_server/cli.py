"""``deltarl env``: run the environment server (uvicorn, one process; Wordle unless
``DELTARL_ENV_TASK`` says otherwise).

Only typer and the settings class are imported here; FastAPI and uvicorn load inside
:func:`serve`, after the arguments are parsed.
"""

from __future__ import annotations

import gc
import logging

import typer
from pydantic import ValidationError

from deltarl.env_server.settings import EnvSettings
from deltarl.services.common.settings import settings_help

logger = logging.getLogger(__name__)


def serve(
    host: str | None = typer.Option(None, "--host", help="Overrides DELTARL_ENV_HOST."),
    port: int | None = typer.Option(None, "--port", help="Overrides DELTARL_ENV_PORT."),
) -> None:
    try:
        settings = EnvSettings()
        overrides = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
        settings = EnvSettings.model_validate(settings.model_dump() | overrides)
    except ValidationError as exc:
        raise typer.BadParameter(str(exc)) from exc

    import uvicorn

    from deltarl.env_server.core.app import create_app

    app = create_app(settings)
    # Move everything allocated so far (modules, schemas, word lists) out of the cyclic GC's
    # reach: full collections then walk only the live sessions' objects (shorter pauses).
    gc.collect()
    gc.freeze()
    private = "token required" if settings.token is not None else "no token (open server)"
    logger.info(
        "%s env server on %s://%s:%d (%s)",
        settings.task,
        settings.scheme,
        settings.host,
        settings.port,
        private,
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        ws_max_size=settings.max_body_bytes,
        access_log=False,
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
        **settings.uvicorn_tls(),
    )


serve.__doc__ = (
    "Run the environment server (Wordle, or the charset task; OpenEnv protocol: HTTP /reset "
    "/step /state, WS /ws).\n\n" + settings_help(EnvSettings)
)
