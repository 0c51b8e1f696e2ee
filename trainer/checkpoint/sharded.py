"""Checkpoints of an FSDP2 trainer: every rank writes its own shards, rank 0 commits.

Same directory, protocol and checks as :mod:`deltarl.trainer.checkpoint.store` (safetensors + JSON, no pickle; one
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

Resharding: ``trainer.json`` records how many rows of each sharded tensor every rank wrote
(``shard_rows``), so a job of another world size restores its own rows from the files whose rows
overlap them (:meth:`ShardedCheckpoint.restore`; every file read is checked whole, and a rank
holds one tensor of one file at a time besides its own rows). A whole-model checkpoint
(``world_size`` 1) is the one-rank case of the same, and a one-process trainer restores an FSDP
checkpoint whole (:func:`gather_whole`). The recorded state digest is over the writer's row
layout, so after a reshard the restored state is checked by those file digests instead. Nothing
here gathers a whole tensor across ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as tdist

from deltarl.trainer.checkpoint.files import FileRecord, read_safetensors, write_safetensors
from deltarl.trainer.checkpoint.store import (
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    Checkpoint,
    Checkpointer,
    CheckpointError,
    CheckpointMeta,
    _json_value,
    _rng_state,
    read_meta,
)
from deltarl.trainer.learn.distributed import DistContext, broadcast
from deltarl.trainer.publish.sharded import local_rows
from deltarl.weightsync.digest import combine_digests, tensor_digest
from deltarl.weightsync.model_state import fp32_names, publish_dtype

logger = logging.getLogger(__name__)

__all__ = ["ShardedCheckpoint", "ShardedCheckpointer", "gather_whole", "sharded_digest"]


def _files(rank: int) -> tuple[str, str, str]:
    return (
        f"model.rank{rank:05d}.safetensors",
        f"optimizer.rank{rank:05d}.safetensors",
        f"rng.rank{rank:05d}.safetensors",
    )


def _written_files(meta: CheckpointMeta, rank: int) -> tuple[str, str, str]:
    """The files rank ``rank`` of the writer wrote (a whole-model checkpoint: its only set)."""
    return (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE) if meta.world_size == 1 else _files(rank)


def _check_listed(ckpt_dir: Path, meta: CheckpointMeta) -> None:
    missing = [
        n for r in range(meta.world_size) for n in _written_files(meta, r) if n not in meta.files
    ]
    if missing:
        raise CheckpointError(f"{ckpt_dir / META_FILE} lists no {missing[:4]}")


def _writer_rows(meta: CheckpointMeta, name: str, rows: int) -> list[int]:
    """Rows of a sharded tensor of ``rows`` rows that each rank of the writer held (optimizer
    state ``"<param>/<key>"``: those of its parameter)."""
    n = meta.world_size
    if n == 1:
        return [rows]
    if meta.shard_rows is not None:
        layout = name if "/" not in name else name.rpartition("/")[0]  # optimizer: its param's
        if layout not in meta.shard_rows:
            raise CheckpointError(f"trainer.json records no rows of the sharded tensor {name!r}")
        return list(meta.shard_rows[layout])
    chunk = -(-rows // n)  # written before shard_rows: FSDP2's even split by rows
    return [min(rows, (r + 1) * chunk) - min(rows, r * chunk) for r in range(n)]


def _pieces(
    meta: CheckpointMeta, want: Mapping[str, tuple[int, int, int]]
) -> tuple[dict[int, dict[str, tuple[int, int]]], dict[str, list[int]]]:
    """For each rank of the writer: the rows (in its file) of every tensor in ``want`` (name ->
    global rows, first and end row wanted) that it holds; and each tensor's rows per rank."""
    out: dict[int, dict[str, tuple[int, int]]] = {}
    layout: dict[str, list[int]] = {}
    for name, (rows, lo, hi) in want.items():
        held = layout[name] = _writer_rows(meta, name, rows)
        if sum(held) != rows or any(r < 0 for r in held) or len(held) != meta.world_size:
            raise CheckpointError(
                f"trainer.json: the ranks' rows of {name!r} ({held}) do not add up to its {rows}"
            )
        if lo == hi:  # this rank holds none of it: an empty slice of the right trailing shape
            out.setdefault(0, {})[name] = (0, 0)
            continue
        start = 0
        for rank, count in enumerate(held):
            a, b = max(lo, start), min(hi, start + count)
            if a < b:
                out.setdefault(rank, {})[name] = (a - start, b - start)
            start += count
    return out, layout


def _assemble(
    ckpt_dir: Path,
    meta: CheckpointMeta,
    model_want: Mapping[str, tuple[int, int, int] | None],
    opt_want: Mapping[str, tuple[int, int, int] | None],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Rows ``lo:hi`` of every sharded tensor (``want`` name -> (rows, lo, hi)) and rank 0's
    copy of every whole one (``want`` name -> None), for the model and the optimizer files,
    read from the writer's files (each checked whole); only the files holding wanted rows are
    read."""
    result: list[dict[str, torch.Tensor]] = []
    for kind, want in ((0, model_want), (1, opt_want)):
        sharded = {k: v for k, v in want.items() if v is not None}
        pieces, layout = _pieces(meta, sharded)
        whole = {k for k, v in want.items() if v is None}
        if whole:
            pieces.setdefault(0, {})
        got: dict[str, list[torch.Tensor]] = {}
        for rank in sorted(pieces):
            mine = pieces[rank]
            expect = {n: held[rank] for n, held in layout.items()}

            def select(
                name: str,
                shape: tuple[int, ...],
                mine: dict[str, tuple[int, int]] = mine,
                expect: dict[str, int] = expect,
                rank: int = rank,
                whole: set[str] = whole,
            ) -> tuple[int, int] | bool:
                if name in expect and (not shape or shape[0] != expect[name]):
                    raise CheckpointError(
                        f"{ckpt_dir}: rank {rank}'s {name!r} has shape {list(shape)}, "
                        f"trainer.json gives it {expect[name]} rows"
                    )
                if name in mine:
                    return mine[name]
                return rank == 0 and name in whole

            fname = _written_files(meta, rank)[kind]
            part = read_safetensors(ckpt_dir / fname, meta.files[fname], rows=select)
            for name, t in part.items():
                got.setdefault(name, []).append(t)
        absent = sorted(set(want) - set(got))
        if absent:
            raise CheckpointError(f"{ckpt_dir}: no file holds {absent[:4]}")
        result.append({n: ts[0] if len(ts) == 1 else torch.cat(ts, dim=0) for n, ts in got.items()})
    return result[0], result[1]


def _opt_want(
    ckpt_dir: Path, meta: CheckpointMeta, model_want: Mapping[str, tuple[int, int, int] | None]
) -> dict[str, tuple[int, int, int] | None]:
    """What to read of the optimizer state (``"<param>/<key>"``, as rank 0 of the writer lists
    it): a parameter's rows for its per-element state, rank 0's copy of its scalars."""
    out: dict[str, tuple[int, int, int] | None] = {}
    for key, dims in _header_dims(ckpt_dir / _written_files(meta, 0)[1]).items():
        pname = key.rpartition("/")[0]
        if pname not in model_want:
            raise CheckpointError(f"{ckpt_dir}: optimizer state {key!r} names no model tensor")
        out[key] = model_want[pname] if dims > 0 else None
    return out


def gather_whole(ckpt_dir: Path, meta: CheckpointMeta) -> Checkpoint:
    """An FSDP checkpoint of ``meta.world_size`` ranks as one whole-model :class:`Checkpoint`
    (for a one-process trainer): every sharded tensor's rows concatenated in rank order."""
    _check_listed(ckpt_dir, meta)
    if meta.shard_rows is None:
        raise CheckpointError(
            f"{ckpt_dir} was written by an FSDP trainer of {meta.world_size} ranks before "
            "checkpoints recorded their row layout: resume it with parallel = 'fsdp' under "
            "torchrun (on any number of ranks)"
        )
    model_want: dict[str, tuple[int, int, int] | None] = {}
    for name in _header_dims(ckpt_dir / _files(0)[0]):
        if name in meta.shard_rows:
            rows = sum(meta.shard_rows[name])
            model_want[name] = (rows, 0, rows)
        else:
            model_want[name] = None
    model, opt = _assemble(ckpt_dir, meta, model_want, _opt_want(ckpt_dir, meta, model_want))
    rng_name = _files(0)[2]
    rng = read_safetensors(ckpt_dir / rng_name, meta.files[rng_name])
    return Checkpoint(ckpt_dir, meta, model, opt, rng, resharded_from=meta.world_size)


def _header_dims(path: Path) -> dict[str, int]:
    """Tensor names and their number of dimensions, from a safetensors file's header (the file
    itself is checked whole when it is read)."""
    from deltarl.weightsync.anchor import read_header

    try:
        with open(path, "rb") as fh:
            _, entries = read_header(fh)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable header ({err})") from None
    return {e.name: len(e.shape) for e in entries}


def _sharded(t: torch.Tensor) -> bool:
    """A DTensor split by rows (the others every rank holds whole)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and t.dim() > 0


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own piece of a DTensor (the tensor itself otherwise), detached."""
    return t.to_local().detach() if hasattr(t, "to_local") else t.detach()


def sharded_digest(model: torch.nn.Module, ctx: DistContext, dtype: torch.dtype) -> str:
    """State digest of the sharded version the publisher makes of ``model`` (a collective:
    every rank's slice digests, gathered; no weights move). Tensors the model keeps in float32
    are hashed in float32, as the publisher's ``follow_precision`` publishes them."""
    keep = fp32_names(model, dtype)
    mine = {
        k: tensor_digest(t.to(publish_dtype(k, dtype, keep)))
        for k, t in local_rows(model, ctx).items()
    }
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
    # written by this many ranks, not this job's number: restore() assembles this rank's rows
    resharded_from: int | None = None

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
        if self.resharded_from is not None:
            self.model, self.optimizer = self._my_rows(state)
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
        if self.resharded_from is not None:
            # the recorded digest is over the writer's row layout; what was restored is checked
            # by the xxh3-128 of every file it came from
            logger.info(
                "rank %d restored step %d from %s, written by %d rank(s)",
                self.ctx.rank,
                self.meta.step,
                self.path,
                self.resharded_from,
            )
            return
        digest = sharded_digest(model, self.ctx, publish_dtype)
        if digest != self.meta.state_digest:
            raise CheckpointError(
                f"{self.path}: the restored shards' digest {digest} differs from the recorded "
                f"{self.meta.state_digest}"
            )
        logger.info("rank %d restored step %d from %s", self.ctx.rank, self.meta.step, self.path)

    def _my_rows(
        self, state: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """This rank's rows of every tensor of the model and the optimizer, from the files of
        the writer's ranks that hold them."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        model_want: dict[str, tuple[int, int, int] | None] = {}
        for name, t in state.items():
            if _sharded(t):
                dt = cast(Any, t)
                shape, offset = compute_local_shape_and_global_offset(
                    dt.shape, dt.device_mesh, dt.placements
                )
                rows = int(_local(t).shape[0])
                if rows != int(shape[0]):
                    raise CheckpointError(f"{name}: a padded local shard cannot be restored")
                model_want[name] = (int(t.shape[0]), int(offset[0]), int(offset[0]) + rows)
            else:
                model_want[name] = None
        return _assemble(
            self.path, self.meta, model_want, _opt_want(self.path, self.meta, model_want)
        )


class ShardedCheckpointer(Checkpointer):
    """:class:`~deltarl.trainer.checkpoint.store.Checkpointer` for FSDP2 ranks (module docstring). Every rank has
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
        groups_acked: int = 0,
        settings: dict[str, Any] | None = None,
        publish_dtype: torch.dtype = torch.bfloat16,
    ) -> Path:
        """Rank 0: write and commit the checkpoint of ``step`` with every rank."""
        extra = {
            "version": version,
            "bucket_version": bucket_version,
            "bucket_digest": bucket_digest,
            "groups_trained": groups_trained,
            "groups_acked": groups_acked,
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
        rows: dict[str, int] = {}
        try:
            opt_tensors, groups = _optimizer_state(model, optimizer)
            rng_tensors, python_rng, numpy_rng = _rng_state()
            model_file, opt_file, rng_file = _files(self.ctx.rank)
            state = model.state_dict()
            local = {n: _local(t).contiguous() for n, t in state.items()}
            rows = {n: int(local[n].shape[0]) for n, t in state.items() if _sharded(t)}
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
        tdist.all_gather_object(gathered, (error, records, rows))
        outcome: str | None = None
        if self.ctx.is_main:
            try:
                errors = [e for e, _, _ in gathered if e is not None]
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
                    files={k: v for _, recs, _ in gathered for k, v in recs.items()},
                    world_size=self.ctx.world_size,
                    shard_rows={n: [r[n] for _, _, r in gathered] for n in gathered[0][2]},
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
            # resharding: restore() reads this rank's rows from the files that hold them; the
            # RNG states of the writer's rank with this rank's number (modulo its ranks)
            _check_listed(ckpt_dir, meta)
            rng_name = _written_files(meta, self.ctx.rank % meta.world_size)[2]
            rng = read_safetensors(ckpt_dir / rng_name, meta.files[rng_name])
            logger.info(
                "%s was written by %d rank(s), this job has %d: resharding",
                ckpt_dir,
                meta.world_size,
                self.ctx.world_size,
            )
            return ShardedCheckpoint(
                ckpt_dir, meta, self.ctx, {}, {}, rng, resharded_from=meta.world_size
            )
        names = _files(self.ctx.rank)
        missing = [n for n in names if n not in meta.files]
        if missing:
            raise CheckpointError(f"{ckpt_dir / META_FILE} lists no {missing}")
        model, opt, rng = (read_safetensors(ckpt_dir / n, meta.files[n]) for n in names)
        return ShardedCheckpoint(ckpt_dir, meta, self.ctx, model, opt, rng)
