"""``deltarl rollout``: run one rollout worker (see :mod:`deltarl.rollout.service.worker`).

Only typer and the settings class are imported here; torch, transformers and the worker load
inside :func:`rollout`, after the settings are parsed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer
from pydantic import ValidationError

from deltarl.rollout.settings import RolloutSettings, check_worker
from deltarl.services.common.settings import settings_help

logger = logging.getLogger(__name__)


def rollout(
    host: str | None = typer.Option(
        None, "--host", help="Interface of /health and /metrics; overrides DELTARL_ROLLOUT_HOST."
    ),
    port: int | None = typer.Option(
        None,
        "--port",
        help="Port of /health and /metrics (0: any free port); overrides DELTARL_ROLLOUT_PORT.",
    ),
    coordinator_url: str | None = typer.Option(
        None, "--coordinator-url", help="Overrides DELTARL_ROLLOUT_COORDINATOR_URL."
    ),
    env_url: str | None = typer.Option(
        None, "--env-url", help="Overrides DELTARL_ROLLOUT_ENV_URL."
    ),
    bucket_uri: str | None = typer.Option(
        None, "--bucket-uri", help="Overrides DELTARL_ROLLOUT_BUCKET_URI."
    ),
    worker_id: str | None = typer.Option(
        None, "--worker-id", help="Overrides DELTARL_ROLLOUT_WORKER_ID."
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        help="The worker's experiment (TOML or JSON: [engine], [episodes], in_flight_groups, "
        "[hints], [teacher]; docs/rollout.md); overrides DELTARL_ROLLOUT_CONFIG.",
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        "-s",
        help="Override an experiment setting: --set episodes.sampling.max_new_tokens=24 "
        "(repeatable).",
    ),
) -> None:
    given = {
        k: v
        for k, v in (
            ("host", host),
            ("port", port),
            ("coordinator_url", coordinator_url),
            ("env_url", env_url),
            ("bucket_uri", bucket_uri),
            ("worker_id", worker_id),
            ("config", config),
        )
        if v is not None
    }
    try:
        settings = RolloutSettings(**given)  # type: ignore[arg-type]
        experiment = settings.experiment(overrides)
        check_worker(settings.teacher_url, experiment)
        experiment.model_source()  # a missing default model is a configuration error
    except ValidationError as exc:
        messages = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise typer.BadParameter(messages) from exc
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc

    from deltarl.rollout.service.http import BindError
    from deltarl.rollout.service.worker import RolloutWorker
    from deltarl.services.coordinator.client import CoordinatorError
    from deltarl.weightsync.errors import StateMismatchError

    logging.getLogger("httpx").setLevel(logging.WARNING)
    logger.info(
        "rollout worker %s: coordinator %s, env %s, %s engine",
        settings.worker_id,
        settings.coordinator_url,
        settings.env_url,
        experiment.engine_settings().type,
    )
    try:
        worker = RolloutWorker.from_settings(settings, experiment)
    except (ValueError, OSError) as exc:  # CA bundle, model directory, bucket URI
        raise typer.BadParameter(str(exc)) from exc
    try:
        worker.run()
    except (CoordinatorError, StateMismatchError, BindError) as exc:  # retrying would not help
        logger.error("rollout worker stopped: %s", exc)
        raise typer.Exit(1) from exc
    finally:
        worker.close()  # the engine (vLLM's engine core process holds the GPU memory)


rollout.__doc__ = (
    "Run a rollout worker: follow the trainer's weight versions, play episodes against the env "
    "server, submit trajectory groups to the coordinator (SIGTERM: graceful shutdown; a second "
    "signal abandons the groups in flight). Serves GET /health (200 while the weights are "
    "verified, else 503) and GET /metrics (Prometheus) on --host/--port.\n\n"
    + "\b\n"
    + settings_help(RolloutSettings)
    + "\n  Also read: the bucket's settings (DELTARL_BUCKET_URI, DELTARL_S3_*, DELTARL_HF_*), "
    "DELTARL_CA_BUNDLE, DELTARL_LOG_LEVEL.\n"
)
