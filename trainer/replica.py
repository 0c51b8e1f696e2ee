"""The side of ranks 1..N-1 in a ``torchrun`` job (see :mod:`deltarl.trainer.learn.distributed` for the protocol).

A replica never talks to the coordinator or the bucket and writes nothing: it receives each
step's batch from rank 0, trains on its share of the rows inside DDP (gradients all-reduced with
every other rank) and takes the same optimizer step, so its weights stay identical to rank 0's,
which publishes them. Under FSDP2 (:mod:`deltarl.trainer.publish.sharded`) it also publishes its own rows of each
version when rank 0 says ``"publish"`` (``publisher`` given). It leaves when rank 0 says so: ``"stop"`` (the run ended or was stopped),
``"timeout"`` (rank 0 gave up waiting for data: :class:`TimeoutError` here too), ``"error"``
(rank 0 stops with an error: :class:`RuntimeError` here).
"""

from __future__ import annotations

import logging

import torch

from deltarl.trainer.checkpoint.sharded import ShardedCheckpoint, ShardedCheckpointer
from deltarl.trainer.checkpoint.store import Checkpoint
from deltarl.trainer.learn.distributed import DistContext, broadcast, wrap_ddp
from deltarl.trainer.learn.optim import build_optimizer
from deltarl.trainer.learn.step import check_reference, train_step
from deltarl.trainer.publish.sharded import ShardedPublisher
from deltarl.trainer.settings import ExperimentSettings

logger = logging.getLogger(__name__)

__all__ = ["train_replica"]


def train_replica(
    model: torch.nn.Module,
    settings: ExperimentSettings,
    dist: DistContext,
    *,
    ref_model: torch.nn.Module | None = None,
    resume: Checkpoint | ShardedCheckpoint | None = None,
    publisher: ShardedPublisher | None = None,
    checkpointer: ShardedCheckpointer | None = None,
) -> int:
    """Follow rank 0's steps until it stops; return the last version rank 0 reported.

    ``model``: this rank's replica (fp32, on this rank's device), built like rank 0's.
    ``resume``: the checkpoint rank 0 resumes from (every rank loads it: the optimizer state
    is per rank). ``publisher``, ``checkpointer``: this rank's sharded publisher and checkpointer
    (FSDP2; None under DDP, where rank 0 alone publishes and checkpoints). ``ref_model``: this
    rank's frozen reference policy (``loss.kl_coef > 0``), built like rank 0's.
    """
    if dist.is_main or not dist.enabled:
        raise ValueError("train_replica is for ranks 1..N-1 of a distributed job")
    check_reference(settings, model, ref_model)
    if publisher is not None:
        publisher.follow_precision(model)  # as rank 0's: the same tensors in fp32
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, settings.max_steps)
    if resume is not None:
        resume.restore(model, opt, sched)
    step_model = wrap_ddp(model, dist)
    steps = 0
    while True:
        kind, payload = broadcast(None, dist)
        if kind == "stop":
            logger.info("rank %d: rank 0 stopped after %d steps here", dist.rank, steps)
            return int(payload)
        if kind == "timeout":
            raise TimeoutError(f"rank 0: {payload}")
        if kind == "error":  # rank 0 stops training with an error (it raises it too)
            raise RuntimeError(f"rank 0: {payload}")
        if kind == "checkpoint":
            if checkpointer is None:
                raise RuntimeError("rank 0 saves a sharded checkpoint but this rank has none")
            checkpointer.save_local(payload, model, opt, sched)
            continue
        if kind == "publish":
            if publisher is None:
                raise RuntimeError(
                    "rank 0 publishes sharded versions but this rank has no publisher"
                )
            version, step, anchor = payload
            publisher.publish_local(publisher.state_of(model), version, step, anchor)
            continue
        assert kind == "step", kind
        batch, _version = payload  # the version these weights have (rank 0's count)
        train_step(step_model, opt, sched, batch, settings, ref_model=ref_model, dist=dist)
        steps += 1
