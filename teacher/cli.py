"""``deltarl teacher``: run the teacher service (uvicorn, one process, one model).

Only typer and the settings class are imported here; torch, FastAPI and uvicorn load inside
:func:`teacher`, after the arguments are parsed.
"""

from __future__ import annotations

import logging

import typer
from pydantic import ValidationError

from deltarl.services.common.settings import settings_help
from deltarl.teacher.settings import TeacherSettings

logger = logging.getLogger(__name__)


def teacher(
    host: str | None = typer.Option(None, "--host", help="Overrides DELTARL_TEACHER_HOST."),
    port: int | None = typer.Option(None, "--port", help="Overrides DELTARL_TEACHER_PORT."),
) -> None:
    overrides = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    try:
        settings = TeacherSettings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise typer.BadParameter(str(exc)) from exc

    import uvicorn

    from deltarl.teacher.app import create_app

    try:
        app = create_app(settings)
    except ValueError as exc:  # no model configured and the default is not installed, ...
        raise typer.BadParameter(str(exc)) from exc
    logger.info(
        "teacher (%s engine) on %s://%s:%d",
        settings.engine,
        settings.scheme,
        settings.host,
        settings.port,
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        access_log=False,
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
        **settings.uvicorn_tls(),
    )


teacher.__doc__ = (
    "Run the teacher service: a teacher model's per-token logprobs (sampled token + top-k) "
    "for given token sequences (POST /v1/logprobs, binary or JSON).\n\n"
    + settings_help(TeacherSettings)
)
