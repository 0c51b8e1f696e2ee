"""``deltarl train``: the trainer process.

Parses the experiment settings (TOML + ``--set`` overrides) and the deployment settings
(environment) first, writes the resolved experiment settings into the run directory, and only
then imports torch and transformers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer
from pydantic import ValidationError

from deltarl.services.settings import settings_help

from .settings import ExperimentSettings, TrainerDeployment

logger = logging.getLogger(__name__)


def train(
    config: Path | None = typer.Option(
        None, "--config", "-c", help="Experiment settings file (.toml or .json)."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a setting: --set loss.clip_high=0.28 (repeatable)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Resolve and write the settings, then exit."
    ),
) -> None:
    try:
        settings = ExperimentSettings.load(config, overrides)
        deploy = TrainerDeployment()
    except (ValidationError, ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    resolved = settings.write_resolved()
    logger.info("settings resolved into %s", resolved)
    if dry_run:
        typer.echo(str(resolved))
        return

    import torch
    from transformers import AutoModelForCausalLM

    from deltarl.services.buckets import open_bucket
    from deltarl.services.coordinator.client import CoordinatorClient

    from .loop import train as run_loop
    from .metrics import MetricsLog
    from .publisher import WeightPublisher

    torch.manual_seed(settings.seed)
    device = deploy.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        settings.model, dtype=torch.float32
    )
    model.to(device)  # fp32 master weights; bf16 compute comes from autocast
    bucket = open_bucket()
    token = deploy.token.get_secret_value() if deploy.token else None
    with CoordinatorClient(deploy.coordinator_url, token) as client:
        publisher = WeightPublisher(
            bucket,
            settings.publish,
            register=client.publish_version,
            tmp_dir=Path(settings.run_dir),
        )
        last = run_loop(
            model,
            settings,
            client,
            publisher,
            sink=MetricsLog(settings.run_dir),
            data_timeout_s=deploy.data_timeout_s,
        )
    logger.info("done: version %d published to %s", last, bucket.uri)


train.__doc__ = (
    "Train with GRPO on the coordinator's trajectories; publish every step to the bucket.\n\n"
    + "\b\n"
    + settings_help(TrainerDeployment)
)
