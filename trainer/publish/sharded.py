"""Sharded publication for an FSDP2 trainer: every rank publishes the rows it holds.

Under FSDP2 (``fully_shard``) each parameter is a DTensor split by rows (``Shard(0)``) over the
ranks. :class:`ShardedPublisher` turns the model after a step into one version without any rank
gathering the state. Order of calls for one version ``v`` (a collective: every rank takes part)::

    rank 0: publish(state, step=...)            ranks 1..N-1: (control loop) ("publish", (v, ...))
      broadcast ("publish", (v, step, anchor))     -> publish_local(state, v, step, anchor)
      every rank, in parallel, one tensor at a time: bf16 cast of its rows (on its device) ->
        the changed elements against its bf16 snapshot of the last version and the encoder's
        context scan of them (on its device, :mod:`~deltarl.weightsync.codec.device_scan`)
        -> the new rows overwrite the snapshot and start copying to the host to be hashed;
        the changes and scans are queued (one synchronization per tensor) and land in pinned
        host memory while the device works on the next tensors; then encode (on the host, from
        O(changed) data, in the rank's thread pool) -> upload its part(s)
      all_gather of the small part records (keys, sizes, xxh3, slice digests, counts)
      rank 0: the manifest (one sharded ObjectRef per kind, listing every rank's part) and
        latest.json, then registration; broadcast of the outcome
      every rank: success -> the snapshot is the new version's; failure -> the next version
        must be an anchor (as WeightPublisher), which rebuilds the snapshot

With ``publish.fp8`` every rank first quantizes its rows to block fp8 (e4m3 rows under its
slice keys, the scale rows of the blocks whose first row it holds, one small all-reduce of the
amax of blocks that straddle ranks: :mod:`~deltarl.trainer.publish.sharded_fp8`); the rest is the same
on that state, whose bytes are one process's fp8 version of the same weights.

A part is an ordinary codec object (delta or anchor) whose tensors are the rank's row ranges,
named by slice keys ``"name[lo:hi]"`` (:func:`~deltarl.weightsync.manifest.slice_key`);
the version's digests are defined over those slice keys: tensor digests of the row ranges,
combined by :func:`~deltarl.weightsync.digest.combine_digests` in key order. So the
state digest of a sharded version depends on the layout (world size), which the manifest records;
a worker computes it the same way from the row views of its full tensors.

Memory per rank for publication: its snapshot (2 bytes per local element, on the device), one
tensor's bf16 cast and the scan's temporaries at a time (about 16 bytes per element of one
16 M-element chunk), the changes and their scans (~18 bytes per changed element on the host,
pinned when they come from a GPU; the delta views them; ~16 more while they are encoded) and,
for rows on a GPU, one pinned host buffer of 2 bytes per local element (the new rows, for the
digests and anchors). Nothing of the other ranks' rows.
Rows on the CPU (or ``scan_on_device=False``) keep the simpler path: a whole bf16 copy of the
new rows next to the snapshot, diffed and scanned on the host.

Not supported here (refused or documented): chained deltas (each version carries standalone
deltas only), publishing in a background thread (the collectives run in the training thread),
whole-state weight proofs (``proof_chunks = 0``, refused; sampled proofs gather only the sampled
chunks' bytes, see :meth:`ShardedPublisher._prove`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from deltarl.buckets import Bucket
from deltarl.trainer.learn.distributed import DistContext, broadcast
from deltarl.trainer.publish.sharded_fp8 import RowLayout, quantize_local_rows
from deltarl.trainer.publish.weights import (
    PROOF_ROUNDS,
    Challenges,
    PublishFailedError,
    PublishReport,
    Register,
    VersionBook,
    pool_answer,
    proof_spec,
)
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync.anchor import encode_anchor
from deltarl.weightsync.codec.bits import float_format
from deltarl.weightsync.codec.compact_chunks import ChunkScan
from deltarl.weightsync.codec.device_scan import (
    SCAN_BYTES_PER_CHANGE,
    PendingScan,
    PinnedStaging,
    start_changes_and_scans,
    warm_up,
)
from deltarl.weightsync.codec.formats import FORMAT_TAGS, encode_delta, resolve_positions
from deltarl.weightsync.delta import Delta, TensorPatch, changed_elements
from deltarl.weightsync.digest import combine_digests, tensor_digest
from deltarl.weightsync.errors import StateMismatchError
from deltarl.weightsync.fp8 import FP8_DTYPE, SCALE_SUFFIX, block_of
from deltarl.weightsync.manifest import ObjectPart, parse_slice_key, slice_key
from deltarl.weightsync.proof import ProofSpec, answer_from, new_nonce, sampled_pieces
from deltarl.weightsync.writer import BucketWriter, NewObject

logger = logging.getLogger(__name__)

PINNED_CHANGE_FRACTION = 0.05
"""FSDP ranks on GPUs: pinned host memory reserved with the first version for the changes' scan
results, as the share of the rank's elements expected to change in a version (18 bytes per
change: 0.05 of a 7B rank's 1.9 G elements is 1.7 GB; optimizer steps change 1-5%). It grows when
a version needs more; without it, torch's caching host allocator slows the first delta by about
a second."""

__all__ = ["ShardedPublisher", "default_codec_threads", "local_rows"]


def default_codec_threads() -> int:
    """This process's share of the node's cores: usable cores // ``LOCAL_WORLD_SIZE`` (set by
    torchrun). Every rank of a node encodes at the same moment, so each one taking every core
    (the single-process default) oversubscribes the node ``LOCAL_WORLD_SIZE`` times."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(32, cores // local))


def delta_from_changes(
    changes: Mapping[str, tuple[np.ndarray, np.ndarray]],
    new: Mapping[str, torch.Tensor],
    base_digests: Mapping[str, str],
    digests: Mapping[str, str],
    base_version: int | None,
    version: int | None,
) -> Delta:
    """The :class:`Delta` that :func:`~deltarl.weightsync.delta.compute_delta` returns
    for the same rows, from parts computed separately: ``changes`` (per tensor, from
    :func:`changed_elements`) and the digests (hashed in threads from the host copy)."""
    patches = {}
    for k in sorted(new):
        fmt = float_format(new[k].dtype)
        index, value = changes[k]
        patches[k] = TensorPatch(
            name=k,
            dtype=fmt.name,
            shape=tuple(new[k].shape),
            index=index,
            value=value.astype(fmt.bits_dtype, copy=False),
            base_digest=base_digests[k],
            result_digest=digests[k],
        )
    return Delta(base_version=base_version, version=version, patches=patches)


def _warm_up() -> None:
    try:
        warm_up()
    except Exception:  # the first delta compiles them instead
        logger.warning("warming up the encoder's kernels failed", exc_info=True)


def _digest_when_ready(t: torch.Tensor, ready: Any) -> str:
    """:func:`tensor_digest` of a host tensor once its copy (CUDA event ``ready``) has landed;
    xxhash releases the GIL on large inputs, so several of these hash in parallel."""
    if ready is not None:
        ready.synchronize()
    return tensor_digest(t)


def _aligned_bytes(n: int) -> int:
    """``n`` rounded up to a multiple of 8 (every dtype's alignment in the host mirror)."""
    return -(-n // 8) * 8


class _HostMirror:
    """The rank's new rows on the host, for the digests (which hash every byte) and anchors.

    One pinned byte buffer (one flat allocation, each tensor at an 8-byte aligned offset, so
    tensors published in float32 sit next to bf16 ones), reused every version: a tensor's copy
    starts on a
    side stream as soon as its rows are final and is hashed as soon as it lands, while the
    device works on the next tensor. The delta's encoder does not read it (the O(n) context
    scan runs on the device, :mod:`~deltarl.weightsync.codec.device_scan`). CPU rows
    are their own mirror (no copy, no buffer)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None
        self._at = 0
        self._stream: Any = None

    @property
    def host_bytes(self) -> int:
        return 0 if self._flat is None else self._flat.numel() * self._flat.element_size()

    def start(
        self, rows: Mapping[str, torch.Tensor], dtype_of: Callable[[str], torch.dtype]
    ) -> None:
        """Size the buffer for ``rows`` (their GPU tensors, each as ``dtype_of(key)``); copies
        start with :meth:`copy`. The previous version's copies must have landed (they have: its
        digests were awaited)."""
        total = sum(
            _aligned_bytes(t.numel() * torch.finfo(dtype_of(k)).bits // 8)
            for k, t in rows.items()
            if t.device.type == "cuda"
        )
        self._at = 0
        if not total:
            return
        if self._flat is None or self._flat.numel() != total:
            self._flat = None  # free the old buffer first
            try:
                self._flat = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as err:  # no pinned memory to be had: correct, slower
                logger.warning("pinned host mirror unavailable (%s); using pageable", err)
                self._flat = torch.empty(total, dtype=torch.uint8)

    def copy(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``t`` (after the work queued on the current stream) into the buffer;
        returns (host tensor, CUDA event reached once the copy has landed). A CPU tensor is
        returned as is, with no event."""
        if t.device.type != "cuda":
            return t, None
        assert self._flat is not None, "start() sizes the buffer first"
        if self._stream is None or self._stream.device != t.device:
            self._stream = torch.cuda.Stream(t.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(t.device))
        nbytes = t.numel() * t.element_size()
        host = self._flat[self._at : self._at + nbytes].view(t.dtype).view(t.shape)
        self._at += _aligned_bytes(nbytes)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        return host, ready

    def settle(self) -> None:
        """Wait for every copy started (a failed version: no copy may still read rows that are
        about to change or be freed)."""
        if self._stream is not None:
            self._stream.synchronize()


def local_rows(model: torch.nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """This rank's rows of every floating-point entry of ``model.state_dict()``, by slice key.

    DTensors (FSDP2 parameters): the local shard, at the global row offset DTensor itself
    reports (``compute_local_shape_and_global_offset``); a rank with no rows of a tensor lists
    none. Plain tensors (replicated buffers): rank 0 holds them whole. Tied weights are listed
    once, under their first name (as :func:`~deltarl.trainer.publish.weights.publishable_state`).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if not t.is_floating_point() or id(t) in seen:
            continue
        seen.add(id(t))
        if t.dim() == 0:
            raise ValueError(f"{name}: a 0-dim tensor cannot be published by rows")
        if isinstance(t, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                t.shape, t.device_mesh, t.placements
            )
            rows = int(shape[0])
            if rows == 0:
                continue
            local = t.to_local().detach()[:rows]
            lo = int(offset[0])
            out[slice_key(name, lo, lo + rows)] = local
        elif ctx.is_main:
            out[slice_key(name, 0, t.shape[0])] = t.detach()
    return out


@dataclass(slots=True)
class _Record:
    """What one rank tells rank 0 about its share of a version (metadata, no weights)."""

    rank: int
    error: str | None = None
    delta: ObjectPart | None = None
    anchor: ObjectPart | None = None
    base_digests: dict[str, str] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # slice key -> tensor digest
    shapes: dict[str, list[int]] = field(default_factory=dict)  # slice key -> its shape
    changed: int = 0
    numel: int = 0
    times: dict[str, float] = field(default_factory=dict)  # cast, diff, encode, upload (s)
    memory: int = 0  # device bytes held for publication (snapshot + new rows or largest cast)
    host_memory: int = 0  # pinned host bytes: the mirror of the new rows and the scans staging


class ShardedPublisher(VersionBook):
    """One per rank of an FSDP2 job (see the module docstring). Rank 0's instance has the
    surface :func:`~deltarl.trainer.loop.train` uses (``publish``, ``wait``, ``close``, ``last_report``);
    the other ranks call :meth:`publish_local` when rank 0's control message says so.

    ``scan_on_device``: find the changes and run the encoder's context scan where the rows are,
    one tensor at a time, overwriting the snapshot in place (default: when the rows are on a
    GPU); False: diff whole copies and scan on the host. Same bytes either way.

    ``on_rank_report``: called on every rank with that rank's timings after each version
    (the benchmark prints them).
    """

    def __init__(
        self,
        bucket: Bucket,
        settings: PublishSettings | None,
        ctx: DistContext,
        *,
        register: Register | None = None,
        challenges: Challenges | None = None,
        dtype: torch.dtype = torch.bfloat16,
        on_report: Callable[[PublishReport], None] | None = None,
        on_rank_report: Callable[[dict[str, Any]], None] | None = None,
        scan_on_device: bool | None = None,
    ) -> None:
        self.settings = settings if settings is not None else PublishSettings()
        if not ctx.enabled:
            raise ValueError("ShardedPublisher is for torchrun jobs; one process: WeightPublisher")
        if self.settings.proof_challenges and self.settings.proof_chunks == 0:
            raise ValueError(
                "publish.proof_chunks = 0 (whole-state weight proofs) is not supported under FSDP: "
                "no rank holds the whole state; sample chunks (proof_chunks > 0) or set "
                "publish.proof_challenges = 0"
            )
        self.bucket, self.ctx, self.register, self.dtype = bucket, ctx, register, dtype
        self.challenges = challenges
        self.on_report, self.on_rank_report = on_report, on_rank_report
        # signed versions: rank 0 signs; every rank records the SHA-256 of the part it uploads
        key_file = self.settings.signing_key_file
        signer = None
        if key_file is not None and ctx.is_main:
            from deltarl.weightsync.signing import Signer

            signer = Signer.from_file(key_file)
        self._writer = BucketWriter(
            bucket,
            anchor_every=self.settings.anchor_every,
            signer=signer,
            sha256=key_file is not None,
        )
        self._base: dict[str, torch.Tensor] | None = None  # bf16 rows of the last version
        self._base_digests: dict[str, str] | None = None
        self._last_version = None
        self._last_report = None
        self._failed = False
        self._threads = self.settings.codec_threads or default_codec_threads()
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="sharded-digest")
        self._mirror = _HostMirror()
        self._staging = PinnedStaging()  # the scans' results (rows on a GPU)
        self._scan_on_device = scan_on_device
        self._fp8_names: frozenset[str] = frozenset()  # quantized tensors (publish.fp8)
        self._fp8_layout: RowLayout | None = None  # their row ranges on every rank
        if self.settings.format == "compact":  # compile the encoder's kernels meanwhile
            self._pool.submit(_warm_up)
        self._bucket_latest = self._writer.reader.latest_version() if ctx.is_main else None
        self.waited_s = 0.0

    # -- the surface of WeightPublisher that the loop uses (rank 0) ----------------------------
    @property
    def threads(self) -> int:
        """Encoder and hashing threads of this rank (:func:`default_codec_threads` unless set)."""
        return self._threads

    def state_of(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's rows of ``model`` (:func:`local_rows`)."""
        return local_rows(model, self.ctx)

    def request_anchor(self) -> None:
        self._writer.request_anchor()

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype tensor ``name`` (or a slice key of it) is published in; with
        ``publish.fp8``: e4m3 for the quantized tensors, float32 for their scales."""
        if self._fp8_names:
            base = name[: name.rindex("[")] if name.endswith("]") and "[" in name else name
            if base in self._fp8_names:
                return FP8_DTYPE
            if base.endswith(SCALE_SUFFIX) and base.removesuffix(SCALE_SUFFIX) in self._fp8_names:
                return torch.float32
        return super().dtype_of(name)

    def wait(self) -> PublishReport | None:
        return self._last_report  # publication is synchronous

    def close(self) -> None:
        """Nothing in flight (publication is synchronous); stops the digest threads."""
        self._pool.shutdown(wait=True)

    def publish(
        self,
        state: Mapping[str, torch.Tensor],
        version: int | None = None,
        *,
        step: int | None = None,
        anchor: bool = False,
    ) -> int:
        """Rank 0: publish this version with every rank (``state``: :func:`local_rows`);
        return its number. Raises :class:`PublishFailedError` if any rank failed (the bucket
        keeps the previous version; the next call must pass ``anchor=True``)."""
        if not self.ctx.is_main:
            raise ValueError("only rank 0 starts a publication; other ranks run publish_local")
        if self._failed and not anchor:
            raise PublishFailedError(
                "a previous publication failed: refusing to publish a delta until the publisher "
                "re-anchors; call publish(..., anchor=True)"
            )
        v = self.next_version() if version is None else version
        if not isinstance(v, int) or isinstance(v, bool) or v <= self.next_version() - 1:
            raise ValueError(f"version {v!r} is not newer than {self.next_version() - 1}")
        with_anchor = anchor or self._base is None or self._writer.should_anchor(v)
        broadcast(("publish", (v, step, with_anchor)), self.ctx)
        ok = self.publish_local(state, v, step, with_anchor)
        if not ok:
            raise PublishFailedError(
                f"publishing version {v} failed on some rank (see the logs of every rank); the "
                f"bucket's newest version is {self._bucket_latest}; continue with "
                "publish(..., anchor=True)"
            )
        return v

    # -- every rank ---------------------------------------------------------------------------
    def publish_local(
        self, state: Mapping[str, torch.Tensor], version: int, step: int | None, anchor: bool
    ) -> bool:
        """This rank's share of ``version`` (a collective; see the module docstring). Returns
        whether the version was committed (the same answer on every rank)."""
        t_start = time.perf_counter()
        new: dict[str, torch.Tensor] | None = None
        record = _Record(rank=self.ctx.rank)
        try:
            if self.settings.fp8:  # a collective that every rank reaches (sharded_fp8.py)
                state, self._fp8_layout = quantize_local_rows(
                    state,
                    super().dtype_of,
                    self.ctx.world_size,
                    block_of(self.settings.fp8_block),
                    layout=self._fp8_layout,
                )
                self._fp8_names = frozenset(self._fp8_layout)
            new, record = self._encode_and_upload(state, version, anchor)
        except Exception as err:  # every rank must reach the gather below
            logger.exception("rank %d: publishing version %d failed", self.ctx.rank, version)
            record.error = f"rank {self.ctx.rank}: {type(err).__name__}: {err}"
        records: list[Any] = [None] * self.ctx.world_size
        tdist.all_gather_object(records, record)
        outcome: str | None = None
        report = None
        if self.ctx.is_main:
            try:
                report = self._commit(records, version, step, anchor, t_start)
            except Exception as err:
                logger.exception("publishing version %d failed", version)
                outcome = f"{type(err).__name__}: {err}"
                self._bucket_latest = self._writer.reader.latest_version()
        outcome = broadcast(outcome, self.ctx)
        if outcome is not None or new is None:
            self._failed = True
            self._mirror.settle()
            if self._scan_on(state):  # the snapshot may be partly overwritten: anchor next
                self._base = self._base_digests = None
            return False
        self._base, self._base_digests = new, record.digests
        self._last_version, self._failed = version, False
        self._prove(version, new, records)
        if report is not None:
            self._last_report = report
            if self.on_report is not None:
                self.on_report(report)
        if self.on_rank_report is not None:
            self.on_rank_report(
                {
                    "rank": self.ctx.rank,
                    "version": version,
                    "changed": record.changed,
                    "numel": record.numel,
                    "bytes": sum(p.size for p in (record.delta, record.anchor) if p is not None),
                    "delta_bytes": None if record.delta is None else record.delta.size,
                    "memory_bytes": record.memory,
                    "host_memory_bytes": record.host_memory,
                    **{f"{k}_s": t for k, t in record.times.items()},
                    "total_s": time.perf_counter() - t_start,
                }
            )
        return True

    def _scan_on(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether this rank finds and scans the changes on the device (rows on a GPU, unless
        ``scan_on_device`` says otherwise)."""
        if self._scan_on_device is not None:
            return self._scan_on_device
        return any(t.device.type == "cuda" for t in state.values())

    def _encode_and_upload(
        self, state: Mapping[str, torch.Tensor], version: int, anchor: bool
    ) -> tuple[dict[str, torch.Tensor], _Record]:
        rec = _Record(rank=self.ctx.rank)
        t0 = time.perf_counter()
        keys = sorted(state)
        base = self._base
        with_delta = (
            base is not None
            and self._base_digests is not None
            and not self._failed
            and set(base) == set(state)
        )
        if with_delta:
            assert base is not None
            for k in keys:
                o, n = base[k], state[k]
                if o.shape != n.shape:
                    raise StateMismatchError(f"{k}: {list(o.shape)} became {list(n.shape)}")
        on_device = self._scan_on(state)
        fmt = self.settings.format
        # every rank holds about its share of the state: the whole is ~ world size times it
        numel = sum(t.numel() for t in state.values())
        positions = resolve_positions(self.settings.positions, numel * self.ctx.world_size)
        # the new rows reach the host (pinned buffer, side stream; CPU rows: themselves) and
        # are hashed in the pool as each copy lands, while this thread works on the next tensor
        self._mirror.start(state, self.dtype_of)
        if on_device:
            # pinned memory for the scans' results, reserved with the first version (an anchor)
            # and grown when a version needed more: allocating it in a delta's hot loop costs
            # about a second per few GB
            on_gpu = sum(t.numel() for t in state.values() if t.device.type == "cuda")
            first = int(on_gpu * PINNED_CHANGE_FRACTION * SCAN_BYTES_PER_CHANGE)
            self._staging.reserve(max(first, self._staging.wanted * 5 // 4))
            self._staging.reset()
        rec.host_memory = self._mirror.host_bytes + self._staging.nbytes
        host_new: dict[str, torch.Tensor] = {}
        digest_of = {}
        changes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        scans: dict[tuple[str, int], ChunkScan] = {}
        t1 = time.perf_counter()
        if on_device:
            # one tensor at a time: cast, changes and their context scan queued on the device,
            # then the new rows overwrite the snapshot in place (same stream: after the scan
            # has read it); a second copy of the rows is never held, and only O(changed) data
            # crosses to the host. (Running the encoder's first phase in the pool during this
            # loop was measured slower: its Python work holds the GIL this thread needs.)
            reuse = base is not None and all(
                k in base and base[k].shape == state[k].shape and base[k].device == state[k].device
                for k in keys
            )
            new = base if reuse and base is not None else {}
            peak = 0
            pending: dict[str, PendingScan] = {}
            for k in keys:
                n = state[k].detach().to(self.dtype_of(k))
                # a tensor published in its own dtype (fp32) is not cast: n is the live rows,
                # which the snapshot must never alias
                fresh = n.untyped_storage().data_ptr() != state[k].untyped_storage().data_ptr()
                peak = max(peak, n.numel() * n.element_size() * fresh)
                if with_delta:
                    assert base is not None
                    pending[k] = start_changes_and_scans(
                        base[k], n, staging=self._staging, ranks=positions != "gaps"
                    )
                if reuse:
                    new[k].copy_(n)
                else:
                    new[k] = n.contiguous() if fresh else n.clone()
                host_new[k], ready = self._mirror.copy(new[k])
                digest_of[k] = self._pool.submit(_digest_when_ready, host_new[k], ready)
            rec.memory = sum(t.numel() * t.element_size() for t in new.values()) + peak
            t_loop = time.perf_counter()
            for k, scan in pending.items():
                index, value, found = scan.result()
                changes[k] = (index, value)
                scans.update(((k, start), sc) for start, sc in found.items())
        else:
            new = {k: state[k].detach().to(self.dtype_of(k), copy=True).contiguous() for k in keys}
            rec.memory = 2 * sum(t.numel() * t.element_size() for t in new.values())
            for k in keys:
                host_new[k], ready = self._mirror.copy(new[k])
                digest_of[k] = self._pool.submit(_digest_when_ready, host_new[k], ready)
            if with_delta:
                assert base is not None
                changes = {k: changed_elements(base[k], new[k]) for k in keys}
            t_loop = time.perf_counter()
        rec.numel = numel  # new holds the same tensors as state
        rec.shapes = {k: list(t.shape) for k, t in new.items()}
        rec.digests = {k: digest_of[k].result() for k in keys}
        delta = None
        if with_delta:
            assert self._base_digests is not None
            delta = delta_from_changes(
                changes, new, self._base_digests, rec.digests, self._last_version, version
            )
            rec.base_digests = dict(self._base_digests)
            rec.changed = delta.changed
        t2 = time.perf_counter()
        blob = anchor_blob = None
        if delta is not None:
            if on_device:  # the base is overwritten: the compact encoder reads the scans
                blob = encode_delta(
                    delta, None, fmt, threads=self._threads, scans=scans, positions=positions
                )
            else:
                blob = encode_delta(delta, base, fmt, threads=self._threads, positions=positions)
        if anchor:
            anchor_blob = encode_anchor(
                dict(host_new), version, self.settings.anchor_compress, digests=rec.digests
            )
        t3 = time.perf_counter()
        slices = sorted(new)
        if blob is not None:
            rec.delta = self._writer.upload_part(version, FORMAT_TAGS[fmt], blob, slices)
        if anchor_blob is not None:
            fmt_tag = "safetensors+zstd" if self.settings.anchor_compress else "safetensors"
            rec.anchor = self._writer.upload_part(version, fmt_tag, anchor_blob, slices)
        t4 = time.perf_counter()
        # loop (device queue and snapshot overwrite) + wait (the scans landing, the digests
        # and the delta's assembly after it) = diff
        rec.times = {
            "cast": t1 - t0,
            "diff": t2 - t1,
            "loop": t_loop - t1,
            "wait": t2 - t_loop,
            "encode": t3 - t2,
            "upload": t4 - t3,
        }
        return new, rec

    def _prove(self, version: int, new: Mapping[str, torch.Tensor], records: list[_Record]) -> None:
        """Weight challenges of ``version`` (a collective, after the commit), in rounds: rank 0
        draws the nonces and the chunks they sample, every rank sends rank 0 the bytes of those
        chunks that lie in its rows (``chunks * PROOF_CHUNK_BYTES`` per nonce, 1 MiB by
        default), rank 0 computes the answers and hands them over. The first round draws
        ``proof_challenges`` nonces (or the pool size the coordinator aimed at for the version
        before, when larger); the next ones as many as the coordinator's answer asks for (its
        fleet), up to :data:`~deltarl.trainer.publish.weights.PROOF_ROUNDS` rounds and
        ``proof_challenges_max`` nonces. No top-ups later (they would need every rank). A
        failure costs only the proofs (logged), as with one process."""
        main = self.ctx.is_main and self.challenges is not None
        count = max(self.settings.proof_challenges, self._proof_target) if main else 0
        if not self.settings.proof_challenges:
            count = 0
        done = 0
        for round_ in range(PROOF_ROUNDS):
            count = min(count, self.settings.proof_challenges_max - done)
            plan = self._proof_plan(records, count) if main and count > 0 else None
            sent = broadcast(None if plan is None else plan[0], self.ctx)
            if sent is None:  # rank 0 is done
                return
            mine = _local_bytes(sent, new)
            every: list[Any] | None = [None] * self.ctx.world_size if self.ctx.is_main else None
            tdist.gather_object(mine, every, dst=0)
            if plan is None or every is None or self.challenges is None:
                continue
            wanted, meta, spec, nonces, samples = plan
            found: dict[tuple[str, int, int], list[tuple[int, bytes]]] = {}
            for part in every:
                for piece, at, data in part:
                    found.setdefault(tuple(piece), []).append((at, data))
            try:
                data = {p: b"".join(d for _, d in sorted(found.get(p, []))) for p in wanted}
                short = [p for p in wanted if len(data[p]) != p[2] - p[1]]
                if short:
                    raise RuntimeError(f"no rank sent the bytes of {short[:3]}")
                pairs = []
                for nonce, sample in zip(nonces, samples, strict=True):
                    chunks = [b"".join(data[p] for p in ps) for _, ps in sample]
                    pairs.append((nonce.hex(), answer_from(meta, nonce, version, spec, chunks)))
                result = self.challenges(version, spec, pairs)
                done += len(pairs)
                count, target = pool_answer(result)
                if round_ == 0 and target:
                    self._proof_target = target
            except Exception as exc:
                logger.warning("version %d: weight challenges not handed over: %s", version, exc)
                count = 0

    def _proof_plan(
        self, records: list[_Record], count: int
    ) -> tuple[list[tuple[str, int, int]], dict[str, Any], ProofSpec, list[bytes], list[Any]]:
        """Rank 0: ``count`` nonces, the chunks they sample (over the whole state's layout) and
        the byte ranges every rank is asked for."""
        spec = proof_spec(self.settings)
        rows: dict[str, int] = {}
        trailing: dict[str, tuple[int, ...]] = {}
        for r in records:
            for key, shape in r.shapes.items():
                name, _, hi = parse_slice_key(key)
                rows[name] = max(rows.get(name, 0), hi)
                trailing[name] = tuple(shape[1:])
        meta = {n: (self.dtype_of(n), (rows[n], *trailing[n])) for n in rows}
        nonces = [new_nonce() for _ in range(count)]
        samples = [sampled_pieces(meta, n, spec) for n in nonces]
        wanted = sorted({p for sample in samples for _, ps in sample for p in ps})
        return wanted, meta, spec, nonces, samples

    def _commit(
        self, records: list[_Record], version: int, step: int | None, anchor: bool, t0: float
    ) -> PublishReport:
        """Rank 0: the manifest from every rank's record, then registration."""
        errors = [r.error for r in records if r.error is not None]
        if errors:
            raise RuntimeError("; ".join(errors))
        digests: dict[str, str] = {}
        for r in records:
            digests.update(r.digests)
        state_digest = combine_digests(digests)
        with_delta = all(r.delta is not None for r in records if r.numel)
        objects: list[NewObject] = []
        if anchor:
            parts = tuple(r.anchor for r in records if r.anchor is not None)
            fmt_tag = "safetensors+zstd" if self.settings.anchor_compress else "safetensors"
            objects.append(NewObject("anchor", fmt_tag, parts))
        if with_delta and self._last_version is not None:
            base_digests: dict[str, str] = {}
            for r in records:
                base_digests.update(r.base_digests)
            objects.append(
                NewObject(
                    "delta",
                    FORMAT_TAGS[self.settings.format],
                    tuple(r.delta for r in records if r.delta is not None),
                    base_version=self._last_version,
                    base_digest=combine_digests(base_digests),
                    changed=sum(r.changed for r in records),
                )
            )
        numel = sum(r.numel for r in records)
        full_bytes = sum(
            math.prod(shape) * torch.finfo(self.dtype_of(key)).bits // 8
            for r in records
            for key, shape in r.shapes.items()
        )
        t_up = time.perf_counter()
        manifest = self._writer.publish(
            version,
            objects,
            state_digest=state_digest,
            numel=numel,
            full_bytes=full_bytes,
            step=step,
        )
        self._bucket_latest = version
        t_reg = time.perf_counter()
        if self.register is not None:
            self.register(manifest)
        t_end = time.perf_counter()
        delta_ref = next((o for o in manifest.objects if o.kind == "delta"), None)
        anchor_ref = next((o for o in manifest.objects if o.kind == "anchor"), None)

        def slowest(key: str) -> float:
            return max(r.times.get(key, 0.0) for r in records)

        return PublishReport(
            version=version,
            step=step,
            base_version=None if delta_ref is None else delta_ref.base_version,
            anchor=anchor_ref is not None,
            delta_format=None if delta_ref is None else delta_ref.format,
            delta_bytes=None if delta_ref is None else delta_ref.size,
            chained_bytes=None,
            anchor_bytes=None if anchor_ref is None else anchor_ref.size,
            changed=None if delta_ref is None else delta_ref.changed,
            numel=numel,
            full_bytes=manifest.full_bytes,
            snapshot_s=slowest("cast"),
            diff_s=slowest("diff"),
            encode_s=slowest("encode"),
            anchor_s=0.0,
            upload_s=slowest("upload") + (t_reg - t_up),
            register_s=t_end - t_reg,
            total_s=t_end - t0,
        )


def _local_bytes(
    wanted: list[tuple[str, int, int]], rows: Mapping[str, torch.Tensor]
) -> list[tuple[tuple[str, int, int], int, bytes]]:
    """The bytes of the ``wanted`` ranges (tensor name, byte lo, byte hi of the whole tensor)
    that lie in this rank's ``rows`` (by slice key): (range, absolute start, bytes)."""
    by_name: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, t in rows.items():
        name, lo, _ = parse_slice_key(key)
        by_name.setdefault(name, []).append((lo, t))
    where: list[tuple[tuple[str, int, int], int]] = []
    views: list[torch.Tensor] = []
    for piece in wanted:
        name, lo, hi = piece
        for row0, t in by_name.get(name, []):
            flat = t.reshape(-1).view(torch.uint8)
            base = row0 * (flat.numel() // max(t.shape[0], 1))
            a, b = max(lo, base), min(hi, base + flat.numel())
            if a < b:
                where.append((piece, a))
                views.append(flat[a - base : b - base])
    if not views:
        return []
    host = torch.cat(views).cpu().numpy().tobytes()  # one copy to the host
    out, at = [], 0
    for (piece, start), v in zip(where, views, strict=True):
        out.append((piece, start, host[at : at + v.numel()]))
        at += v.numel()
    return out
