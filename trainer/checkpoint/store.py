"""Checkpoints of the trainer: everything :func:`~deltarl.trainer.loop.train` needs to continue, without pickle.

Tensors go to safetensors files, everything else to one JSON file; nothing is ever unpickled,
so loading a checkpoint cannot run code. Layout of the checkpoint directory
(``checkpoint.path``, default ``<run_dir>/checkpoints``)::

    latest                      "step_000120": the commit point, replaced atomically
    step_000100/                an older checkpoint (the newest ``keep`` are kept)
    step_000120/
        model.safetensors       model.state_dict() by name: the fp32 master weights (+ buffers)
        optimizer.safetensors   "<param name>/<key>": AdamW exp_avg, exp_avg_sq, step per param
        rng.safetensors         "torch/cpu", "torch/cuda/<i>" (uint8 states), "numpy/mt19937"
        trainer.json            CheckpointMeta: step, versions, digests, scheduler, param
                                groups, python/numpy RNG scalars, data counters, settings,
                                size + xxh3-128 of every file above, its own checksum
    .tmp-step_000140-1a2b3c4d/  a write in progress, or one a crash interrupted: never read

Write protocol (:meth:`Checkpointer.save`), in this order:

1. remove leftover ``.tmp-*`` directories (one trainer per checkpoint directory);
2. write every file into a fresh ``.tmp-step_N-<hex>/``, each hashed while written and fsynced,
   ``trainer.json`` last; fsync the directory;
3. rename it to ``step_N/`` (replacing a same-named leftover that ``latest`` does not name);
4. write ``latest.tmp``, fsync, rename over ``latest`` (the commit point), fsync the directory;
5. delete all but the newest ``keep`` committed checkpoints, and any uncommitted ``step_*``
   directory newer than ``latest``.

A crash (or an exception) anywhere before step 4 leaves ``latest`` naming the previous
checkpoint, whose files were never touched; a crash after it leaves the new one committed.

Loading (:meth:`Checkpointer.load`) checks ``trainer.json``'s checksum, then the size and
xxh3-128 of every file while reading it, and the safetensors headers; :meth:`Checkpoint.restore`
checks names, shapes and dtypes against the model and optimizer before changing anything, and
afterwards that the publishable bf16 cast of the restored weights has the recorded state digest.
Any mismatch is a :class:`CheckpointError` naming the file and what is wrong.

The data cursor lives in the coordinator: a group is gone from its queue once the trainer acks
its lease after the step, so a resumed trainer simply leases the next groups. Groups acked after
the last checkpoint were trained on by steps that the crash lost; they are not trained on again
(asynchronous RL tolerates that: they are old rollouts by then). The checkpoint keeps the
trainer's own counters (``groups_trained``, ``groups_acked``) so that they continue.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deltarl.trainer.checkpoint.files import (
    CheckpointError,
    FileRecord,
    fsync_dir,
    read_safetensors,
    write_json,
    write_safetensors,
)
from deltarl.trainer.settings import CHECKPOINT_POINTER
from deltarl.weightsync.digest import combine_digests, tensor_digest
from deltarl.weightsync.model_state import fp32_names, publish_dtype, publishable_state

logger = logging.getLogger(__name__)

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointMeta",
    "Checkpointer",
    "published_digest",
]

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
META_FILE = "trainer.json"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointMeta(BaseModel):
    """Content of ``trainer.json``: what is not a tensor, and how to check the tensor files."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1] = Field(default=1, description="Layout version of a checkpoint.")
    step: int = Field(ge=0, description="Optimizer steps done: training resumes at step + 1.")
    version: int = Field(
        ge=0, description="Policy version the publisher gave these weights (maybe uncommitted)."
    )
    state_digest: str = Field(
        description="State digest of the published (bf16) cast of these weights: the digest a "
        "replica holding `version` has."
    )
    bucket_version: int | None = Field(
        description="Newest version committed in the bucket when saving (None: none yet); may "
        "lag `version` by the one in flight."
    )
    bucket_digest: str | None = Field(description="That version's state digest.")
    groups_trained: int = Field(ge=0, description="Groups trained on since the run began.")
    groups_acked: int = Field(
        default=0,
        ge=0,
        description="Groups the coordinator acknowledged to this lineage since the run began: "
        "trained, refused (dead letters) or too stale; equals the coordinator's acked total "
        "when one trainer lineage acked them all. 0 in checkpoints that predate it.",
    )
    created_at: datetime = Field(description="When the checkpoint was written (UTC).")
    param_groups: list[dict[str, Any]] = Field(
        description="Optimizer param groups: hyperparameters, and 'params' as parameter names."
    )
    optimizer_scalars: dict[str, dict[str, Any]] = Field(
        description="Non-tensor optimizer state by parameter name (empty for AdamW)."
    )
    scheduler: dict[str, Any] = Field(description="lr_scheduler.state_dict() (JSON values).")
    python_rng: list[Any] = Field(description="random.getstate() as JSON lists.")
    numpy_rng: dict[str, Any] = Field(
        description="np.random.get_state() besides its key array (stored in rng.safetensors)."
    )
    settings: dict[str, Any] = Field(description="The experiment settings of the saving run.")
    files: dict[str, FileRecord] = Field(description="Every tensor file: size and digest.")
    world_size: int = Field(
        default=1,
        ge=1,
        description="Ranks of the FSDP trainer that wrote it (one file set per rank, "
        ".checkpoint_sharded); 1: a whole-model checkpoint.",
    )
    shard_rows: dict[str, list[int]] | None = Field(
        default=None,
        description="FSDP checkpoints: rows of each sharded model tensor held by each rank, in "
        "rank order (tensors every rank holds whole are absent): how a job of another world size "
        "reassembles them. None: a whole-model checkpoint (or an FSDP one written before it).",
    )
    checksum: str = Field(description="xxh3-128 of the other keys (canonical JSON).")


def _checksum(raw: Mapping[str, Any]) -> str:
    own = {k: v for k, v in raw.items() if k != "checksum"}
    return xxhash.xxh3_128_hexdigest(
        json.dumps(own, sort_keys=True, separators=(",", ":")).encode()
    )


def published_digest(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> str:
    """State digest of what the publisher makes of ``model``: its floating-point state cast to
    ``dtype`` (float32 for the tensors the model keeps in float32, as the publisher's
    ``follow_precision``): the digest a replica holding that version computes."""
    # one cast at a time: no second copy of the model on its device
    state = publishable_state(model)
    keep = fp32_names(model, dtype, state)
    return combine_digests(
        {n: tensor_digest(t.detach().to(publish_dtype(n, dtype, keep))) for n, t in state.items()}
    )


# ---------------------------------------------------------------------------------------------
# state <-> files


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _json_value(name: str, value: Any) -> Any:
    if isinstance(value, tuple):
        value = list(value)
    try:
        json.dumps(value, allow_nan=True)
    except TypeError:
        raise CheckpointError(
            f"{name}: {type(value).__name__} cannot be stored in a checkpoint (no pickle); "
            "only JSON values and tensors can"
        ) from None
    return value


def _optimizer_to_files(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    names = _param_names(model)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for gi, group in enumerate(optimizer.param_groups):
        params: list[str] = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError("the optimizer holds a parameter the model does not name")
            name = names[id(p)]
            params.append(name)
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{name}/{key}"] = value.detach()
                else:
                    scalars.setdefault(name, {})[key] = _json_value(f"{name}/{key}", value)
        hyper = {
            k: _json_value(f"param_groups[{gi}].{k}", v) for k, v in group.items() if k != "params"
        }
        groups.append({**hyper, "params": params})
    return tensors, scalars, groups


def _rng_state() -> tuple[dict[str, torch.Tensor], list[Any], dict[str, Any]]:
    tensors = {"torch/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # else CUDA was never used
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch/cuda/{i}"] = s
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    tensors["numpy/mt19937"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, py_state, gauss = random.getstate()
    return (
        tensors,
        [version, list(py_state), gauss],
        {
            "kind": kind,
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    )


def _restore_rng(tensors: Mapping[str, torch.Tensor], meta: CheckpointMeta) -> None:
    torch.set_rng_state(tensors["torch/cpu"])
    count = sum(k.startswith("torch/cuda/") for k in tensors)
    cuda = [tensors[f"torch/cuda/{i}"] for i in range(count)]
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
    elif cuda:
        logger.warning(
            "checkpoint has %d CUDA RNG state(s), this host %d device(s): CUDA RNG not restored",
            len(cuda),
            torch.cuda.device_count() if torch.cuda.is_available() else 0,
        )
    n = meta.numpy_rng
    keys = tensors["numpy/mt19937"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    version, py_state, gauss = meta.python_rng
    random.setstate((version, tuple(py_state), gauss))


def _mismatches(
    what: str, got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]
) -> list[str]:
    problems = []
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        problems.append(f"{len(missing)} missing from the checkpoint, e.g. {missing[:3]}")
    if extra:
        problems.append(f"{len(extra)} not in the {what}, e.g. {extra[:3]}")
    for n in sorted(set(got) & set(want)):
        a, b = got[n], want[n]
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(
                f"{n}: checkpoint {a.dtype}{list(a.shape)}, {what} {b.dtype}{list(b.shape)}"
            )
    return problems


# ---------------------------------------------------------------------------------------------
# public surface


@dataclass(slots=True)
class Checkpoint:
    """A loaded and checked checkpoint (tensors on the CPU); :meth:`restore` applies it."""

    path: Path
    meta: CheckpointMeta
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    # assembled from the files of an FSDP checkpoint of this many ranks (None: whole-model)
    resharded_from: int | None = None

    def restore(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        rng: bool = True,
        publish_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """Load weights, optimizer and scheduler state (and the RNG states when ``rng``) into
        freshly built objects of the same architecture and optimizer.

        Everything is checked before anything changes; after loading, the ``publish_dtype``
        cast of the weights must have the recorded state digest.
        """
        problems = _mismatches("model", self.model, model.state_dict())
        names = _param_names(model)
        params = dict(model.named_parameters())
        current = [[names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups]
        if current != [g["params"] for g in self.meta.param_groups]:
            problems.append(
                "the optimizer's parameter groups do not list the checkpoint's parameters in the "
                "same order"
            )
        for key, t in self.optimizer.items():
            pname, _, _ = key.rpartition("/")
            if pname not in params:
                problems.append(f"optimizer state {key!r} names no parameter of the model")
            elif t.dim() > 0 and t.shape != params[pname].shape:
                problems.append(f"optimizer state {key!r}: shape {list(t.shape)}")
        problems += [
            f"optimizer state of {pname!r} names no parameter of the model"
            for pname in self.meta.optimizer_scalars
            if pname not in params
        ]
        if problems:
            raise CheckpointError(
                f"{self.path} does not fit this model/optimizer: " + "; ".join(problems[:8])
            )
        model.load_state_dict(self.model, strict=True)

        index: dict[str, int] = {}
        groups: list[dict[str, Any]] = []
        for group, saved in zip(optimizer.param_groups, self.meta.param_groups, strict=True):
            ids = []
            for p in group["params"]:
                index[names[id(p)]] = len(index)
                ids.append(index[names[id(p)]])
            hyper = {k: v for k, v in saved.items() if k != "params"}
            if isinstance(hyper.get("betas"), list):
                hyper["betas"] = tuple(hyper["betas"])
            groups.append({**hyper, "params": ids})
        state: dict[int, dict[str, Any]] = {}
        for key, t in self.optimizer.items():
            pname, _, k = key.rpartition("/")
            state.setdefault(index[pname], {})[k] = t
        for pname, extra in self.meta.optimizer_scalars.items():
            state.setdefault(index[pname], {}).update(extra)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        scheduler.load_state_dict(dict(self.meta.scheduler))
        if rng:
            _restore_rng(self.rng, self.meta)
        if self.resharded_from is not None:
            # the recorded digest is over the writer's row layout (a sharded version's digest):
            # what was restored is checked by the xxh3-128 of every file it came from
            logger.info("restored from %d ranks' files, each checked", self.resharded_from)
        else:
            digest = published_digest(model, publish_dtype)
            if digest != self.meta.state_digest:
                raise CheckpointError(
                    f"{self.path}: the restored weights' {publish_dtype} digest {digest} differs "
                    f"from the recorded {self.meta.state_digest}"
                )
        logger.info(
            "restored step %d (version %d) from %s", self.meta.step, self.meta.version, self.path
        )


def read_meta(ckpt_dir: Path) -> CheckpointMeta:
    """``trainer.json`` of a checkpoint directory, checked (checksum, schema)."""
    meta_path = ckpt_dir / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path} is missing: not a (complete) checkpoint")
    try:
        raw = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{meta_path} is not valid JSON ({err})") from None
    if not isinstance(raw, dict) or raw.get("checksum") != _checksum(raw):
        raise CheckpointError(f"{meta_path}: checksum mismatch (the file was modified)")
    try:
        return CheckpointMeta.model_validate(raw)
    except ValidationError as err:
        raise CheckpointError(f"{meta_path} is malformed: {err}") from None


class Checkpointer:
    """Saves, lists, loads and prunes the checkpoints of one run (see the module docstring).

    ``root``: the checkpoint directory (one trainer writes to it at a time). ``keep``: how many
    committed checkpoints to keep (>= 1).
    """

    def __init__(self, root: str | Path, *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    @staticmethod
    def dir_name(step: int) -> str:
        return f"step_{step:06d}"

    def latest(self) -> Path | None:
        """The committed checkpoint ``latest`` names; None when there is none yet."""
        pointer = self.root / CHECKPOINT_POINTER
        if not pointer.is_file():
            return None
        name = pointer.read_text(encoding="utf-8").strip()
        if not _STEP_DIR.match(name):
            raise CheckpointError(f"{pointer} holds {name!r}, not a checkpoint name")
        path = self.root / name
        if not path.is_dir():
            raise CheckpointError(f"{pointer} names {name}, which is missing in {self.root}")
        return path

    def committed(self) -> list[tuple[int, Path]]:
        """Committed checkpoints (step, path), oldest first: ``step_*`` up to ``latest``."""
        latest = self.latest()
        if latest is None:
            return []
        limit = self._step_of(latest)
        return [(s, p) for s, p in self._step_dirs() if s <= limit]

    def save(
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
        settings: Mapping[str, Any] | None = None,
        publish_dtype: torch.dtype = torch.bfloat16,
    ) -> Path:
        """Write and commit the checkpoint of ``step``; return its directory.

        ``version``: the policy version these weights were published as. ``bucket_version``,
        ``bucket_digest``: the bucket's ``latest.json`` now. Returns the existing directory
        without writing when ``latest`` already names this step (the state cannot have
        changed without a step). Checkpoints of later steps are deleted after the commit: they
        are uncommitted leftovers, or a branch abandoned by resuming from an older checkpoint.
        A damaged ``latest`` is replaced (with a warning), not an error: saving repairs it.
        """
        name = self.dir_name(step)
        try:
            current = self.latest()
        except CheckpointError as err:
            logger.warning("%s; the checkpoint being written replaces it", err)
            current = None
        if current is not None and current.name == name:
            logger.debug("checkpoint %s is already the latest", current)
            return current
        tmp = self._fresh_tmp(name)
        try:
            opt_tensors, opt_scalars, groups = _optimizer_to_files(model, optimizer)
            rng_tensors, python_rng, numpy_rng = _rng_state()
            files = {
                MODEL_FILE: write_safetensors(tmp / MODEL_FILE, model.state_dict()),
                OPTIMIZER_FILE: write_safetensors(tmp / OPTIMIZER_FILE, opt_tensors),
                RNG_FILE: write_safetensors(tmp / RNG_FILE, rng_tensors),
            }
            meta = CheckpointMeta(
                step=step,
                version=version,
                state_digest=published_digest(model, publish_dtype),
                bucket_version=bucket_version,
                bucket_digest=bucket_digest,
                groups_trained=groups_trained,
                groups_acked=groups_acked,
                created_at=datetime.now(UTC),
                param_groups=groups,
                optimizer_scalars=opt_scalars,
                scheduler={
                    k: _json_value(f"scheduler.{k}", v) for k, v in scheduler.state_dict().items()
                },
                python_rng=python_rng,
                numpy_rng=numpy_rng,
                settings=dict(settings or {}),
                files=files,
                checksum="",
            )
            final = self._commit(tmp, name, meta)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("checkpoint of step %d (version %d) committed: %s", step, version, final)
        self._prune(step)
        return final

    def _fresh_tmp(self, name: str) -> Path:
        """Steps 1-2 of the write protocol: leftovers removed, a fresh temporary directory."""
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(TMP_PREFIX + "*"):
            logger.warning("removing %s, left by an interrupted checkpoint write", leftover)
            shutil.rmtree(leftover)
        tmp = self.root / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def _commit(self, tmp: Path, name: str, meta: CheckpointMeta) -> Path:
        """Steps 2-4: ``trainer.json`` (with its checksum) written last into ``tmp``, which is
        renamed to ``name``; then the ``latest`` pointer moves (the commit point)."""
        raw = meta.model_dump(mode="json")
        raw["checksum"] = _checksum(raw)
        write_json(tmp / META_FILE, raw)
        fsync_dir(tmp)
        final = self.root / name
        if final.exists():  # uncommitted: left by a crash between rename and pointer
            logger.warning("replacing %s, never committed by an interrupted write", final)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        pointer_tmp = self.root / f"{CHECKPOINT_POINTER}.tmp"
        with open(pointer_tmp, "w", encoding="utf-8") as fh:
            fh.write(name + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(pointer_tmp, self.root / CHECKPOINT_POINTER)
        fsync_dir(self.root)
        return final

    def load(self, path: str | Path | None = None) -> Checkpoint:
        """Read and check a checkpoint (default: the latest); raise :class:`CheckpointError`
        with what is wrong when it is missing or damaged."""
        if path is None:
            found = self.latest()
            if found is None:
                raise CheckpointError(f"no checkpoint in {self.root} (no {CHECKPOINT_POINTER})")
            path = found
        ckpt_dir = Path(path)
        meta = read_meta(ckpt_dir)
        if meta.world_size != 1:
            from deltarl.trainer.checkpoint.sharded import gather_whole

            return gather_whole(ckpt_dir, meta)
        meta_path = ckpt_dir / META_FILE
        expected = {MODEL_FILE, OPTIMIZER_FILE, RNG_FILE}
        if set(meta.files) != expected:
            raise CheckpointError(f"{meta_path} lists {sorted(meta.files)}, not {sorted(expected)}")
        model = read_safetensors(ckpt_dir / MODEL_FILE, meta.files[MODEL_FILE])
        optimizer = read_safetensors(ckpt_dir / OPTIMIZER_FILE, meta.files[OPTIMIZER_FILE])
        rng = read_safetensors(ckpt_dir / RNG_FILE, meta.files[RNG_FILE])
        if "torch/cpu" not in rng or "numpy/mt19937" not in rng:
            raise CheckpointError(f"{ckpt_dir / RNG_FILE} lacks the torch or numpy RNG state")
        return Checkpoint(ckpt_dir, meta, model, optimizer, rng)

    # -- internals -----------------------------------------------------------------------------
    @staticmethod
    def _step_of(path: Path) -> int:
        m = _STEP_DIR.match(path.name)
        assert m is not None, path
        return int(m.group(1))

    def _step_dirs(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [(self._step_of(p), p) for p in self.root.iterdir() if _STEP_DIR.match(p.name)]
        return sorted(x for x in found if x[1].is_dir())

    def _prune(self, latest_step: int) -> None:
        dirs = self._step_dirs()
        committed = [p for s, p in dirs if s <= latest_step]
        doomed = committed[: -self.keep] + [p for s, p in dirs if s > latest_step]
        for p in doomed:
            logger.debug("removing checkpoint %s", p)
            shutil.rmtree(p)
