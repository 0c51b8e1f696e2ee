"""``deltarl train``: the trainer process.

Parses the experiment settings (TOML + ``--set`` overrides) and the deployment settings
(environment) first, writes the resolved experiment settings into the run directory, and only
then imports torch and transformers.

``--resume`` continues from the latest checkpoint of the run (``checkpoint.path``, default
``<run_dir>/checkpoints``): weights, optimizer, scheduler, RNG and step come from it, and its
weights are published as a fresh anchor. SIGINT/SIGTERM finish the current step, checkpoint and
exit with 128 + the signal number; a second signal stops at once.

With ``loss.kl_coef > 0`` every rank also loads the frozen reference policy: the starting model
``settings.model`` again (on ``--resume`` too: the KL stays to the model the run started from),
sharded like the policy under FSDP (:func:`_reference`).

Under ``torchrun --nproc_per_node N -m deltarl train ...`` every rank parses the same settings;
rank 0 writes them, talks to the coordinator, publishes and reports, the other ranks train their
share of each step as DDP replicas (:mod:`deltarl.trainer.learn.distributed`). Without torchrun: one process, as
before.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from pydantic import ValidationError

from deltarl.services.common.settings import settings_help
from deltarl.trainer.reporting import check_trackers
from deltarl.trainer.settings import (
    CHECKPOINT_POINTER,
    RESOLVED_NAME,
    ExperimentSettings,
    TrainerDeployment,
)

if TYPE_CHECKING:  # the launcher imports torch only after parsing the settings
    import torch

    from deltarl.trainer.checkpoint.sharded import ShardedCheckpoint
    from deltarl.trainer.checkpoint.store import Checkpoint, Checkpointer
    from deltarl.trainer.learn.distributed import DistContext
    from deltarl.trainer.loop import GracefulStop
    from deltarl.weightsync.manifest import VersionManifest

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
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue from the latest checkpoint of the run (publishes its weights as an anchor).",
    ),
) -> None:
    quiet_http_logs()
    try:
        settings = ExperimentSettings.load(config, overrides)
        deploy = TrainerDeployment()
    except (ValidationError, ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    ckpt_dir = settings.checkpoint_dir()
    if resume and not (ckpt_dir / CHECKPOINT_POINTER).is_file():
        raise typer.BadParameter(
            f"no checkpoint to resume from in {ckpt_dir} (no {CHECKPOINT_POINTER} file); check "
            "run_dir / checkpoint.path, or start without --resume",
            param_hint="--resume",
        )
    try:
        check_trackers(list(settings.report.to))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="report.to") from exc
    rank = int(os.environ.get("RANK", "0"))  # torchrun's; the process group comes later
    resolved = settings.write_resolved() if rank == 0 else Path(settings.run_dir) / RESOLVED_NAME
    logger.info("settings resolved into %s", resolved)
    if dry_run:
        typer.echo(str(resolved))
        return
    code = _run(settings, deploy, resume=resume)
    if code:
        raise typer.Exit(code)


def quiet_http_logs() -> None:
    """httpx logs every request at INFO: one line per lease poll (every second while the trainer
    waits for data). Keep its warnings only, unless the log level is DEBUG."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)


def _run(settings: ExperimentSettings, deploy: TrainerDeployment, *, resume: bool) -> int:
    """Load the model and train (rank 0: the loop; other torchrun ranks: a replica); return
    the exit code (128 + signal after a stop request, else 0)."""
    import torch

    from deltarl.trainer.checkpoint.sharded import ShardedCheckpointer
    from deltarl.trainer.checkpoint.store import Checkpointer, CheckpointError
    from deltarl.trainer.learn.distributed import (
        init_distributed,
        shard_fsdp,
        shutdown_distributed,
    )
    from deltarl.trainer.loop import GracefulStop
    from deltarl.trainer.replica import train_replica

    ctx, device = init_distributed(deploy.device, timeout_s=deploy.dist_timeout_s)
    clean = False
    try:
        fsdp = ctx.enabled and settings.parallel == "fsdp"
        checkpointer = (
            ShardedCheckpointer(settings.checkpoint_dir(), ctx, keep=settings.checkpoint.keep)
            if fsdp
            else Checkpointer(settings.checkpoint_dir(), keep=settings.checkpoint.keep)
        )
        try:
            checkpoint = checkpointer.load() if resume else None
        except CheckpointError as exc:
            raise typer.BadParameter(str(exc), param_hint="--resume") from exc
        ref_model = _reference(settings, ctx, device, fsdp)
        torch.manual_seed(settings.seed)
        model = _load_model(settings.model, device)  # fp32 master weights
        if fsdp:
            shard_fsdp(model, ctx, device)
        with GracefulStop() as stopper:
            if ctx.is_main:
                _run_main(
                    model, settings, deploy, stopper, checkpointer, checkpoint, ctx, ref_model
                )
            else:  # rank 0 decides when to stop; a signal here only sets the exit code
                publisher = None
                if fsdp:
                    from deltarl.buckets import open_bucket
                    from deltarl.trainer.publish.sharded import ShardedPublisher

                    publisher = ShardedPublisher(open_bucket(), settings.publish, ctx)
                train_replica(
                    model,
                    settings,
                    ctx,
                    ref_model=ref_model,
                    resume=checkpoint,
                    publisher=publisher,
                    checkpointer=checkpointer
                    if isinstance(checkpointer, ShardedCheckpointer)
                    else None,
                )
        clean = True
    finally:
        shutdown_distributed(ctx, clean=clean)
    return 0 if stopper.signum is None else 128 + stopper.signum


def _load_model(source: str, device: str) -> torch.nn.Module:
    """The causal LM of ``source`` in fp32 on ``device`` (bf16 compute comes from autocast)."""
    import torch
    from transformers import AutoModelForCausalLM

    from deltarl.services.common.models import resolve_model

    path = resolve_model(source)  # a prepared model's name (smollm2, tiny, ...): its directory
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device)


def _reference(
    settings: ExperimentSettings, ctx: DistContext, device: str, fsdp: bool
) -> torch.nn.Module | None:
    """The frozen reference policy of ``loss.kl_coef > 0`` (None when it is 0): the starting
    model ``settings.model`` loaded like the policy (same seed, fp32, same device), in eval mode
    without gradients; on ``--resume`` still that starting model, not the resumed weights. A
    second copy of the weights: 4 bytes per parameter on every rank under DDP, 4/N under FSDP,
    where it is sharded like the policy. Built before the policy, so that at most one whole
    model is on a device at a time under FSDP."""
    if settings.loss.kl_coef <= 0:
        return None
    import torch

    from deltarl.trainer.learn.distributed import shard_fsdp
    from deltarl.trainer.learn.step import frozen_reference

    torch.manual_seed(settings.seed)  # as the policy's: the same weights a checkpoint lacks
    ref = frozen_reference(_load_model(settings.model, device))
    if fsdp:
        shard_fsdp(ref, ctx, device)
    logger.info(
        "reference policy for loss.kl_coef = %s: %s (frozen)", settings.loss.kl_coef, settings.model
    )
    return ref


def _run_main(
    model: torch.nn.Module,
    settings: ExperimentSettings,
    deploy: TrainerDeployment,
    stopper: GracefulStop,
    checkpointer: Checkpointer,
    checkpoint: Checkpoint | ShardedCheckpoint | None,
    ctx: DistContext,
    ref_model: torch.nn.Module | None,
) -> None:
    """Rank 0 (or the only process): coordinator client, publisher, reporter, the loop."""
    from deltarl.buckets import open_bucket
    from deltarl.services.coordinator.client import CoordinatorClient
    from deltarl.trainer.loop import train as run_loop
    from deltarl.trainer.publish.sharded import ShardedPublisher
    from deltarl.trainer.publish.weights import (
        VersionBook,
        WeightPublisher,
        coordinator_challenge_need,
        coordinator_challenges,
    )
    from deltarl.trainer.reporting import build_reporter
    from deltarl.trainer.screen import model_limits

    bucket = open_bucket()
    token = deploy.token.get_secret_value() if deploy.token else None
    limits = model_limits(model)  # every version tells the coordinator what the model takes

    with CoordinatorClient(deploy.coordinator_url, token) as client:

        def register(manifest: VersionManifest) -> None:
            client.publish_version(manifest, limits)

        publisher: VersionBook
        if ctx.enabled and settings.parallel == "fsdp":
            publisher = ShardedPublisher(
                bucket,
                settings.publish,
                ctx,
                register=register,
                challenges=coordinator_challenges(client),
            )
        else:
            publisher = WeightPublisher(
                bucket,
                settings.publish,
                register=register,
                challenges=coordinator_challenges(client),
                challenge_need=coordinator_challenge_need(client),
                tmp_dir=Path(settings.run_dir),
            )
        with build_reporter(settings) as reporter:
            last = run_loop(
                model,
                settings,
                client,
                publisher,
                sink=reporter,
                ref_model=ref_model,
                data_timeout_s=deploy.data_timeout_s,
                stop=stopper.event,
                checkpointer=checkpointer,
                resume=checkpoint,
                dist=ctx,
            )
    if stopper.signum is not None:
        logger.warning(
            "stopped by signal %d; version %d is the last published; continue with --resume",
            stopper.signum,
            last,
        )
    else:
        logger.info("done: version %d published to %s", last, bucket.uri)


train.__doc__ = (
    "Train with GRPO on the coordinator's trajectories; publish every step to the bucket.\n\n"
    + "\b\n"
    + settings_help(TrainerDeployment)
)
