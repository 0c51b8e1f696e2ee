"""Checkpoints of an FSDP2 trainer: every rank writes its own shards, rank 0 commits.

Same directory, protocol and checks as :mod:`.checkpoint` (safetensors + JSON, no pickle; one
``trainer.json`` with the size and xxh3-128 of every file; the ``latest`` pointer as the commit
point), with one file set per rank::

    step_000120/
        model.rank00000.safetensors       this rank's rows of every parameter (DTensor local)
        optimizer.rank00000.safetensors   its rows of the AdamW state ("<param>/<key>")
        rng.rank00000.safetensors         its RNG states
        model.rank00001.safetensors ...
        trainer.json                      CheckpointMeta with world_size = N, written by rank 0

Order of a save (a collective; rank 0 tells the other ranks with a ``"checkpoint"`` control
message): rank 0 makes the temporary directory and broadcasts its name; every rank writes and
fsyncs its files; rank 0 gathers their records, writes ``trainer.json`` last, renames and moves
``latest``; the outcome is broadcast. The checkpoint directory must be one shared file system
for every node. ``state_digest`` is the sharded state digest of the published bf16 rows (the
digest a worker holding that sharded version has), rechecked after a restore.

Resume needs the same world size (a checkpoint of N ranks is refused elsewhere with a clear
error); resharding is not implemented. Nothing here gathers a whole tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from deltarl.services.weightsync.digest import combine_digests, tensor_digest
from deltarl.trainer.checkpoint import (
    META_FILE,
    Checkpointer,
    CheckpointError,
    CheckpointMeta,
    _json_value,
    _rng_state,
    read_meta,
)
from deltarl.trainer.checkpoint_files import FileRecord, read_safetensors, write_safetensors
from deltarl.trainer.distributed import DistContext, broadcast
from deltarl.trainer.sharded import local_rows

logger = logging.getLogger(__name__)

__all__ = ["ShardedCheckpoint", "ShardedCheckpointer", "sharded_digest"]


def _files(rank: int) -> tuple[str, str, str]:
    return (
        f"model.rank{rank:05d}.safetensors",
        f"optimizer.rank{rank:05d}.safetensors",
        f"rng.rank{rank:05d}.safetensors",
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own piece of a DTensor (the tensor itself otherwise), detached."""
    return t.to_local().detach() if hasattr(t, "to_local") else t.detach()


def sharded_digest(model: torch.nn.Module, ctx: DistContext, dtype: torch.dtype) -> str:
    """State digest of the sharded version the publisher makes of ``model`` (a collective:
    every rank's slice digests, gathered; no weights move)."""
    mine = {k: tensor_digest(t.to(dtype)) for k, t in local_rows(model, ctx).items()}
    parts: list[Any] = [None] * ctx.world_size
    tdist.all_gather_object(parts, mine)
    return combine_digests({k: v for part in parts for k, v in part.items()})


def _optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    groups: list[dict[str, Any]] = []
    for gi, group in enumerate(optimizer.param_groups):
        params = []
        for p in group["params"]:
            params.append(names[id(p)])
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(f"{names[id(p)]}/{key}: only tensor optimizer state")
                tensors[f"{names[id(p)]}/{key}"] = _local(value)
        hyper = {
            k: _json_value(f"param_groups[{gi}].{k}", v) for k, v in group.items() if k != "params"
        }
        groups.append({**hyper, "params": params})
    return tensors, groups


@dataclass(slots=True)
class ShardedCheckpoint:
    """This rank's files of a sharded checkpoint, read and checked; :meth:`restore` loads them
    (a collective: the digest check gathers every rank's slice digests)."""

    path: Path
    meta: CheckpointMeta
    ctx: DistContext
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]

    def restore(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        publish_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        from torch.distributed.tensor import DTensor

        params = dict(model.named_parameters())
        state = {n: t for n, t in model.state_dict().items()}
        problems = [n for n in state if n not in self.model]
        problems += [n for n in self.model if n not in state]
        problems += [
            f"{n}: {list(self.model[n].shape)} vs {list(_local(state[n]).shape)}"
            for n in state
            if n in self.model and self.model[n].shape != _local(state[n]).shape
        ]
        if problems:
            raise CheckpointError(f"{self.path} does not fit this sharded model: {problems[:5]}")
        with torch.no_grad():
            for n, t in state.items():
                _local(t).copy_(self.model[n])
        index = {n: i for i, n in enumerate(n for g in self.meta.param_groups for n in g["params"])}
        groups = []
        for saved in self.meta.param_groups:
            hyper = {k: v for k, v in saved.items() if k != "params"}
            if isinstance(hyper.get("betas"), list):
                hyper["betas"] = tuple(hyper["betas"])
            groups.append({**hyper, "params": [index[n] for n in saved["params"]]})
        opt_state: dict[int, dict[str, Any]] = {}
        for key, t in self.optimizer.items():
            pname, _, k = key.rpartition("/")
            p = params[pname]
            if isinstance(p, DTensor) and t.dim() > 0:
                t = DTensor.from_local(
                    t.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            opt_state.setdefault(index[pname], {})[k] = t
        optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
        scheduler.load_state_dict(dict(self.meta.scheduler))
        torch.set_rng_state(self.rng["torch/cpu"])
        digest = sharded_digest(model, self.ctx, publish_dtype)
        if digest != self.meta.state_digest:
            raise CheckpointError(
                f"{self.path}: the restored shards' digest {digest} differs from the recorded "
                f"{self.meta.state_digest}"
            )
        logger.info("rank %d restored step %d from %s", self.ctx.rank, self.meta.step, self.path)


class ShardedCheckpointer(Checkpointer):
    """:class:`~.checkpoint.Checkpointer` for FSDP2 ranks (module docstring). Every rank has
    one; rank 0's :meth:`save` starts the collective, the others join with :meth:`save_local`."""

    def __init__(self, root: str | Path, ctx: DistContext, *, keep: int = 3) -> None:
        super().__init__(root, keep=keep)
        self.ctx = ctx

    def save(  # type: ignore[override]
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        version: int,
        bucket_version: int | None = None,
        bucket_digest: str | None = None,
        groups_trained: int = 0,
        settings: dict[str, Any] | None = None,
        publish_dtype: torch.dtype = torch.bfloat16,
    ) -> Path:
        """Rank 0: write and commit the checkpoint of ``step`` with every rank."""
        extra = {
            "version": version,
            "bucket_version": bucket_version,
            "bucket_digest": bucket_digest,
            "groups_trained": groups_trained,
            "settings": dict(settings or {}),
        }
        broadcast(("checkpoint", step), self.ctx)
        return self.save_local(step, model, optimizer, scheduler, extra, publish_dtype)

    def save_local(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        extra: dict[str, Any] | None = None,
        publish_dtype: torch.dtype = torch.bfloat16,
    ) -> Path:
        """This rank's part of a save (every rank; ``extra``: rank 0's meta fields)."""
        name = self.dir_name(step)
        tmp = broadcast(self._fresh_tmp(name) if self.ctx.is_main else None, self.ctx)
        error = None
        records: dict[str, FileRecord] = {}
        try:
            opt_tensors, groups = _optimizer_state(model, optimizer)
            rng_tensors, python_rng, numpy_rng = _rng_state()
            model_file, opt_file, rng_file = _files(self.ctx.rank)
            local = {n: _local(t).contiguous() for n, t in model.state_dict().items()}
            records = {
                model_file: write_safetensors(tmp / model_file, local),
                opt_file: write_safetensors(tmp / opt_file, opt_tensors),
                rng_file: write_safetensors(tmp / rng_file, rng_tensors),
            }
        except Exception as err:  # every rank must reach the gather
            logger.exception("rank %d: checkpoint of step %d failed", self.ctx.rank, step)
            error = f"rank {self.ctx.rank}: {type(err).__name__}: {err}"
        digest = sharded_digest(model, self.ctx, publish_dtype)
        gathered: list[Any] = [None] * self.ctx.world_size
        tdist.all_gather_object(gathered, (error, records))
        outcome: str | None = None
        if self.ctx.is_main:
            try:
                errors = [e for e, _ in gathered if e is not None]
                if errors:
                    raise CheckpointError("; ".join(errors))
                assert extra is not None
                meta = CheckpointMeta(
                    step=step,
                    state_digest=digest,
                    created_at=datetime.now(UTC),
                    param_groups=groups,
                    optimizer_scalars={},
                    scheduler={
                        k: _json_value(f"scheduler.{k}", v)
                        for k, v in scheduler.state_dict().items()
                    },
                    python_rng=python_rng,
                    numpy_rng=numpy_rng,
                    files={k: v for _, recs in gathered for k, v in recs.items()},
                    world_size=self.ctx.world_size,
                    checksum="",
                    **extra,
                )
                self._commit(tmp, name, meta)
                self._prune(step)
            except Exception as err:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
                outcome = f"{type(err).__name__}: {err}"
        outcome = broadcast(outcome, self.ctx)
        if outcome is not None:
            raise CheckpointError(f"checkpoint of step {step} failed: {outcome}")
        logger.info("rank %d: checkpoint of step %d committed", self.ctx.rank, step)
        return self.root / name

    def load(self, path: str | Path | None = None) -> ShardedCheckpoint:  # type: ignore[override]
        """This rank's files of a checkpoint (default: the latest), checked."""
        ckpt_dir = Path(path) if path is not None else self.latest()
        if ckpt_dir is None:
            raise CheckpointError(f"no checkpoint in {self.root}")
        meta = read_meta(ckpt_dir)
        if meta.world_size != self.ctx.world_size:
            raise CheckpointError(
                f"{ckpt_dir} was written by {meta.world_size} rank(s), this job has "
                f"{self.ctx.world_size}: resume on as many ranks (resharding is not implemented)"
            )
        names = _files(self.ctx.rank)
        missing = [n for n in names if n not in meta.files]
        if missing:
            raise CheckpointError(f"{ckpt_dir / META_FILE} lists no {missing}")
        model, opt, rng = (read_safetensors(ckpt_dir / n, meta.files[n]) for n in names)
        return ShardedCheckpoint(ckpt_dir, meta, self.ctx, model, opt, rng)
