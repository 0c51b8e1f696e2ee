"""The trainer's side of weight sync: every optimizer step becomes a published version.

:class:`WeightPublisher` turns the model's weights after a step into version ``v``:

1. **snapshot** (caller's thread): cast every tensor to bf16 and copy it into a host buffer
   (pinned and asynchronous for CUDA tensors; buffers are reused from step to step, so host
   memory stays at two bf16 copies of the model); with ``publish.fp8`` the linear weights are
   quantized to block fp8 (:func:`~deltarl.weightsync.fp8.quantize_state`: e4m3 values +
   float32 block scales, bf16 for the rest): CUDA tensors on their GPU before the copy (the
   host receives and keeps one byte an element: two fp8 versions), CPU tensors from the bf16
   snapshot in the publishing thread (one bf16 snapshot and two fp8 versions); everything
   below works on that fp8 state;
2. **diff**: :func:`~deltarl.weightsync.delta.compute_delta` against the host mirror of
   the last published state, whose tensor digests are remembered (only the new state is hashed);
3. **encode**: the delta in the configured format (``compact`` by default), and an anchor when
   due: the first version of this publisher (so always on resume), every ``anchor_every``
   versions, on :meth:`~WeightPublisher.request_anchor` or ``publish(..., anchor=True)``; an
   anchor of a model larger than ``anchor_in_memory_max_bytes`` is streamed to a temp file.
   With the compact format and ``chained_deltas``, a delta ``v -> w`` whose base ``v`` was
   itself published by a delta ``u -> v`` of this publisher (the previous publish succeeded)
   is also encoded *chained* on that delta (``context_version=u``, see
   :mod:`~deltarl.weightsync.codec.context`): a second object next to the standalone one,
   for replicas whose last applied delta was ``u -> v``, published only if it is smaller;
4. **upload**: :meth:`BucketWriter.publish <deltarl.weightsync.writer.BucketWriter.publish>`
   (objects, manifest, then the ``latest.json`` commit);
5. **register**: the manifest is handed to ``register`` (``CoordinatorClient.publish_version``),
   after the bucket commit, so a worker that hears of ``v`` can always fetch it.

Steps 2-5 run in one background thread when ``background`` is set, overlapping the next step's
compute. Call order for the trainer::

    pub = WeightPublisher(bucket, settings.publish, register=client.publish_version)
    for step in ...:
        optimizer.step()
        pub.publish(model.state_dict(), step=step)   # returns after the snapshot
        ...                                          # next step's forward/backward overlaps
    pub.close()                                      # waits for the last version

Guarantees:

* Versions are published strictly in order: :meth:`~WeightPublisher.publish` first waits for
  the previous version to be committed and registered (that wait is counted in
  :attr:`~WeightPublisher.waited_s`), and the version numbers must increase.
* A failure at any step leaves the bucket's previous version intact (the publication protocol
  never moves ``latest.json`` before a version is complete) and the host mirror unchanged. The
  failure is raised as :class:`PublishFailedError` by the next :meth:`~WeightPublisher.publish`
  or :meth:`~WeightPublisher.wait`; from then on the publisher refuses deltas until it
  re-anchors: ``publish(..., anchor=True)`` publishes an anchor-only version, which replicas
  load from nothing, so nobody ever applies a delta against a state whose publication was not
  confirmed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltarl.buckets import Bucket
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync.anchor import encode_anchor, write_anchor
from deltarl.weightsync.codec.context import DeltaContext
from deltarl.weightsync.codec.formats import FORMAT_TAGS, encode_delta, resolve_positions
from deltarl.weightsync.delta import compute_delta
from deltarl.weightsync.digest import combine_digests, state_digests
from deltarl.weightsync.fp8 import (
    block_of,
    is_quantized,
    quantize_block_fp8,
    quantize_state,
    scale_name,
)
from deltarl.weightsync.manifest import VersionManifest
from deltarl.weightsync.model_state import fp32_names, publish_dtype
from deltarl.weightsync.model_state import publishable_state as publishable_state
from deltarl.weightsync.proof import DEFAULT_CHUNK_BYTES, ProofSpec, make_challenges
from deltarl.weightsync.writer import BucketWriter, NewObject

logger = logging.getLogger(__name__)

Register = Callable[[VersionManifest], Any]
# (version, spec, [(nonce hex, answer hex)]): hands a version's weight challenges over; the
# answer may say how many more the coordinator wants (``wanted``) and the pool size it aims at
# (``target``), as ChallengePoolResult does
Challenges = Callable[[int, ProofSpec, list[tuple[str, str]]], Any]
# version -> how many more challenges the coordinator wants for it now (top-ups)
ChallengeNeed = Callable[[int], int]
# hand-overs per version at publish time: the first, then what the coordinator asks for
PROOF_ROUNDS = 3


def pool_answer(result: Any) -> tuple[int, int]:
    """``(wanted, target)`` of a challenge hand-over's answer (0, 0 when it says nothing)."""
    return int(getattr(result, "wanted", 0) or 0), int(getattr(result, "target", 0) or 0)


# Bytes per sampled chunk of a weight proof: 4 KiB, a page, so a chunk costs one read and the
# default 256 chunks hash 1 MiB per challenge. The chunk count (``proof_chunks``) sets the
# strength; tests with tiny states make chunks small to cross tensor and rank boundaries.
PROOF_CHUNK_BYTES = DEFAULT_CHUNK_BYTES


def proof_spec(settings: PublishSettings) -> ProofSpec:
    """What this trainer's weight proofs sample (:data:`PROOF_CHUNK_BYTES`, ``proof_chunks``)."""
    return ProofSpec(PROOF_CHUNK_BYTES, settings.proof_chunks)


def proof_threads(settings: PublishSettings) -> int:
    """Threads computing weight challenges: the codec's, else up to 8 cores."""
    return settings.codec_threads or max(1, min(8, os.cpu_count() or 1))


def coordinator_challenges(client: Any) -> Challenges:
    """:data:`Challenges` that uploads to a coordinator (``CoordinatorClient``)."""
    from deltarl.services.coordinator.schemas import ChallengePair, ChallengePool

    def upload(version: int, spec: ProofSpec, pairs: list[tuple[str, str]]) -> Any:
        pool = ChallengePool(
            chunk_bytes=spec.chunk_bytes,
            chunks=spec.chunks,
            items=[ChallengePair(nonce=n, answer=a) for n, a in pairs],
        )
        return client.add_challenges(version, pool)

    return upload


def coordinator_challenge_need(client: Any) -> ChallengeNeed:
    """:data:`ChallengeNeed` from a coordinator (``CoordinatorClient.challenge_pool``)."""

    def need(version: int) -> int:
        return int(client.challenge_pool(version).wanted)

    return need


class PublishFailedError(RuntimeError):
    """Publishing a version failed (its ``__cause__`` says why), or a delta was asked for after
    such a failure. The bucket still holds the previous version; publish with ``anchor=True``."""


@dataclass(frozen=True, slots=True)
class PublishReport:
    """What publishing one version cost. Times in seconds, sizes in bytes.

    Example: ``PublishReport(version=12, step=12, base_version=11, anchor=False,
    delta_format="deltarl-compact-v3", delta_bytes=301_220, chained_bytes=282_410,
    anchor_bytes=None, changed=1_402_113, numel=134_515_008, full_bytes=269_030_016,
    snapshot_s=0.02, diff_s=0.11, encode_s=0.65, anchor_s=0.0, upload_s=0.05, register_s=0.004,
    total_s=0.82)``.
    """

    version: int
    step: int | None
    base_version: int | None  # the delta's base; None when the version has no delta
    anchor: bool  # the version carries an anchor
    delta_format: str | None  # format tag of the delta; None without delta
    delta_bytes: int | None  # the standalone delta
    chained_bytes: int | None  # the delta chained on the previous one; None without one
    anchor_bytes: int | None
    changed: int | None  # elements whose bits changed since base_version; None without delta
    numel: int  # elements of the whole state (fp8 versions: scales included)
    full_bytes: int  # raw bytes of the whole published state (bf16, or fp8 + scales + bf16)
    snapshot_s: float  # in the trainer's thread: cast + copy to host
    diff_s: float  # delta and digests of the new state
    encode_s: float  # delta encoding (standalone and chained, with the context capture)
    anchor_s: float  # anchor encoding (0 without anchor)
    upload_s: float  # objects, manifest and latest pointer
    register_s: float  # coordinator registration (0 without coordinator)
    total_s: float  # from the end of the snapshot to registration
    prove_s: float = 0.0  # weight challenges computed and handed over (after total_s)

    @property
    def density(self) -> float | None:
        """Fraction of elements that changed; None without delta."""
        return None if self.changed is None else self.changed / max(self.numel, 1)

    def metrics(self, prefix: str = "publish/") -> dict[str, float]:
        """Flat numeric view for the metrics log (absent values are left out)."""
        out: dict[str, float] = {"version": float(self.version), "anchor": float(self.anchor)}
        for key in ("delta_bytes", "chained_bytes", "anchor_bytes", "changed", "density"):
            value = getattr(self, key)
            if value is not None:
                out[key] = float(value)
        for key in (
            "snapshot_s",
            "diff_s",
            "encode_s",
            "anchor_s",
            "upload_s",
            "register_s",
            "prove_s",
        ):
            out[key] = getattr(self, key)
        out["total_s"] = self.total_s
        return {prefix + k: v for k, v in out.items()}


@dataclass(slots=True)
class _Snapshot:
    state: dict[str, torch.Tensor]  # host, contiguous, publish dtype
    ready: Any  # torch.cuda.Event to wait on before reading ``state``; None when already ready
    snapshot_s: float


class VersionBook:
    """What every publisher is (this one and the sharded one, :class:`~.sharded.ShardedPublisher`):
    the interface the training loop uses (:meth:`state_of`, :meth:`publish`, :meth:`wait`,
    :meth:`request_anchor`, :meth:`close`), the version bookkeeping, and the publish precision:
    every tensor in ``dtype``, except the names in ``keep_fp32`` (set by
    :meth:`follow_precision` from the model), published in float32."""

    bucket: Bucket  # where versions go
    waited_s: float = 0.0  # time publish() and wait() spent waiting for a version in flight
    dtype: torch.dtype = torch.bfloat16
    keep_fp32: frozenset[str] = frozenset()
    _last_version: int | None = None
    _last_report: PublishReport | None = None
    _failed: bool = False
    _bucket_latest: int | None = None
    _proof_target: int = 0  # the challenge pool size the coordinator aimed at for the last version

    @property
    def last_version(self) -> int | None:
        """Newest version this publisher committed (None before the first)."""
        return self._last_version

    @property
    def last_report(self) -> PublishReport | None:
        return self._last_report

    @property
    def failed(self) -> bool:
        """True after a failed publication, until an anchor-only version succeeded."""
        return self._failed

    def follow_precision(self, model: torch.nn.Module) -> frozenset[str]:
        """Publish in float32 the tensors that ``model`` (a Hugging Face model) keeps in float32
        when loaded in :attr:`dtype` (:func:`~deltarl.weightsync.model_state.fp32_names`:
        DeepSeek-V3's router; nothing for most models), so that a replica built by transformers
        in that dtype holds exactly what is published. Call before the first version (the
        training loop does); returns the names."""
        self.keep_fp32 = fp32_names(model, self.dtype)
        if self.keep_fp32:
            logger.info(
                "publishing %d tensors in float32 as the model keeps them (e.g. %s)",
                len(self.keep_fp32),
                sorted(self.keep_fp32)[0],
            )
        return self.keep_fp32

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype tensor ``name`` (or a slice key of it) is published in."""
        return publish_dtype(name, self.dtype, self.keep_fp32)

    def next_version(self) -> int:
        """The version :meth:`publish` uses when given none: one past the newest known."""
        known = [v for v in (self._last_version, self._bucket_latest) if v is not None]
        return max(known) + 1 if known else 0

    # -- the interface: each publisher implements these -------------------------------------
    def state_of(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What :meth:`publish` takes of ``model``: the whole state, or this rank's rows."""
        raise NotImplementedError

    def publish(
        self,
        state: Mapping[str, torch.Tensor],
        version: int | None = None,
        *,
        step: int | None = None,
        anchor: bool = False,
    ) -> int:
        """Publish ``state`` as ``version`` (default :meth:`next_version`); return its number."""
        raise NotImplementedError

    def wait(self) -> PublishReport | None:
        """Wait for the version in flight; return the newest report (None if nothing yet)."""
        raise NotImplementedError

    def request_anchor(self) -> None:
        """Make the next version carry an anchor."""
        raise NotImplementedError

    def close(self) -> None:
        """Finish what is in flight and release threads."""
        raise NotImplementedError


class WeightPublisher(VersionBook):
    """Publishes the trainer's weights after every optimizer step (see the module docstring).

    ``bucket``: where versions go (one publisher per bucket). ``settings``: format, anchor
    policy, background thread. ``register``: called with each committed manifest, e.g.
    ``CoordinatorClient.publish_version``; None: no coordinator. ``challenges``: called after
    ``register`` with fresh weight challenges of the version (nonces and the answers computed on
    the published state, :mod:`deltarl.weightsync.proof`), e.g.
    :func:`coordinator_challenges`: ``publish.proof_challenges`` of them (or the pool size the
    coordinator aimed at for the version before, when larger), then as many more as its answer
    asks for (``wanted``), up to ``publish.proof_challenges_max`` per version; None: none.
    ``challenge_need``: how many more the coordinator wants for a version now (e.g.
    :func:`coordinator_challenge_need`): a background thread asks every
    ``publish.proof_topup_s`` and tops the newest version's pool up from the state this
    publisher still holds (workers that join or retry); None: no top-ups. ``dtype``: what is
    published (the bf16 cast of fp32 master weights; see :meth:`~VersionBook.follow_precision`
    for tensors a model keeps in fp32). ``tmp_dir``: where large anchors are staged (None:
    the system temp dir). ``on_report``: called (in the publishing thread) with each version's
    :class:`PublishReport`.
    """

    #: devices whose tensors a ``publish.fp8`` snapshot quantizes where they are (in the caller's
    #: thread, before the copy to the host); tensors elsewhere are quantized in the publishing
    #: thread, off the training loop's path
    QUANTIZE_ON: frozenset[str] = frozenset({"cuda"})

    def __init__(
        self,
        bucket: Bucket,
        settings: PublishSettings | None = None,
        *,
        register: Register | None = None,
        challenges: Challenges | None = None,
        challenge_need: ChallengeNeed | None = None,
        dtype: torch.dtype = torch.bfloat16,
        tmp_dir: str | Path | None = None,
        on_report: Callable[[PublishReport], None] | None = None,
    ) -> None:
        self.settings = settings if settings is not None else PublishSettings()
        self.bucket = bucket
        self.register = register
        self.challenges = challenges
        self.challenge_need = challenge_need
        self.dtype = dtype
        self.tmp_dir = None if tmp_dir is None else Path(tmp_dir)
        self.on_report = on_report
        signer = None
        if self.settings.signing_key_file is not None:
            from deltarl.weightsync.signing import Signer

            signer = Signer.from_file(self.settings.signing_key_file)
        self._publisher = BucketWriter(
            bucket, anchor_every=self.settings.anchor_every, signer=signer
        )
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="deltarl-publish")
            if self.settings.background
            else None
        )
        self._pending: Future[PublishReport] | None = None
        # Written by the publishing thread, read by the caller only after waiting for it.
        self._base: dict[str, torch.Tensor] | None = None  # host mirror of the last version
        self._base_digests: dict[str, str] | None = None
        self._spare: dict[str, torch.Tensor] | None = None  # reusable snapshot buffers
        self._last_version = None
        self._last_report = None
        # Context of the last published delta (into _last_version), for the next chained delta;
        # None after an anchor-only version, a failure, on resume or when chaining is off.
        self._context: DeltaContext | None = None
        self._chain_pool = ThreadPoolExecutor(1, thread_name_prefix="deltarl-chained-encode")
        self._failed = False
        self._bucket_latest = self._publisher.reader.latest_version()
        self.waited_s = 0.0
        # weight challenges: the newest version's state is read by top-ups under this lock,
        # which the publishing thread holds to make a new version the base
        self._proof_lock = threading.Lock()
        self._proof_target = 0  # the pool size the coordinator aimed at for the last version
        self._proofs: tuple[int, int] | None = None  # (version, challenges computed for it)
        self._top_up_stop = threading.Event()
        self._top_up_thread: threading.Thread | None = None
        if (
            challenges is not None
            and challenge_need is not None
            and self.settings.proof_challenges
            and self.settings.proof_topup_s > 0
        ):
            self._top_up_thread = threading.Thread(
                target=self._top_up_loop, name="deltarl-proof-top-up", daemon=True
            )
            self._top_up_thread.start()

    # -- public surface ------------------------------------------------------------------------
    def request_anchor(self) -> None:
        """Make the next published version carry an anchor (besides its delta)."""
        self._publisher.request_anchor()

    def state_of(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole state of ``model`` (:func:`publishable_state`)."""
        return publishable_state(model)

    def publish(
        self,
        state: Mapping[str, torch.Tensor],
        version: int | None = None,
        *,
        step: int | None = None,
        anchor: bool = False,
    ) -> int:
        """Publish ``state`` (tensors of any float dtype, CPU or CUDA) as ``version``; return
        the version number (the weights' policy version from now on).

        Waits for the previous version first and raises its failure, if any, as
        :class:`PublishFailedError`. Returns once ``state`` is snapshotted: the caller may
        modify its tensors right after. With ``background`` off, returns after registration.
        ``version`` defaults to :meth:`next_version`. ``anchor``: include an anchor; after a
        failure it is required, and the version then carries only the anchor.
        """
        self._collect()
        if self._failed and not anchor:
            raise PublishFailedError(
                "a previous publication failed: refusing to publish a delta until the publisher "
                "re-anchors; call publish(..., anchor=True)"
            )
        v = self.next_version() if version is None else version
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"version must be a non-negative int, got {v!r}")
        newest = self.next_version() - 1
        if v <= newest:
            raise ValueError(
                f"version {v} is not newer than version {newest}, the newest published by this "
                f"publisher or found in {self.bucket.uri}; versions must strictly increase"
            )
        if not state:
            raise ValueError("state has no tensors")
        snap = self._snapshot(state)
        if self._executor is None:
            self._last_report = self._run_guarded(snap, v, step, anchor)
        else:
            self._pending = self._executor.submit(self._run_guarded, snap, v, step, anchor)
        return v

    def wait(self) -> PublishReport | None:
        """Wait for the version in flight; return the newest report (None if nothing yet).

        Raises :class:`PublishFailedError` if that version failed. Time spent here is added to
        :attr:`waited_s`.
        """
        self._collect()
        return self._last_report

    def close(self) -> None:
        """Wait for the version in flight (raising its failure) and stop the thread."""
        try:
            self._collect()
        finally:
            self._top_up_stop.set()
            if self._top_up_thread is not None:
                self._top_up_thread.join()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._chain_pool.shutdown(wait=True)

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _collect(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = time.perf_counter()
        try:
            self._last_report = pending.result()
        finally:
            self.waited_s += time.perf_counter() - t0

    def _snapshot(self, state: Mapping[str, torch.Tensor]) -> _Snapshot:
        t0 = time.perf_counter()
        spare, self._spare = self._spare or {}, None
        out: dict[str, torch.Tensor] = {}
        cuda = False
        block = block_of(self.settings.fp8_block) if self.settings.fp8 else None
        for name, t in state.items():
            src = t.detach()
            if not src.is_floating_point():
                raise ValueError(f"{name}: {src.dtype} is not a floating-point weight")
            dtype = self.dtype_of(name)
            cuda = cuda or src.device.type == "cuda"
            on_device = src.device.type in self.QUANTIZE_ON
            if block is not None and on_device and is_quantized(name, src.shape, dtype):
                # on the device, without waiting for it: the host gets 1 byte an element (and
                # the scales), not 2; a non-finite block's scale fails the version in the
                # publishing thread (quantize_state)
                q, scale = quantize_block_fp8(src.to(dtype), block, name=name, check=False)
                for key, x in ((name, q), (scale_name(name), scale)):
                    out[key] = _host_copy(x, x.dtype, spare.get(key))
            else:
                out[name] = _host_copy(src, dtype, spare.get(name))
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        return _Snapshot(out, ready, time.perf_counter() - t0)

    def _run_guarded(
        self, snap: _Snapshot, version: int, step: int | None, anchor: bool
    ) -> PublishReport:
        try:
            report = self._run(snap, version, step, anchor)
        except BaseException as err:
            self._failed = True
            self._context = None
            # Where the bucket stands decides the next version number (a failure after the
            # commit, e.g. in registration, used this one up); if the bucket cannot even be
            # read now, keep the last known value: the next publish re-checks anyway.
            with contextlib.suppress(Exception):
                self._bucket_latest = self._publisher.reader.latest_version()
            logger.error(
                "publishing version %d failed (%s); the bucket's newest version is %s; the next "
                "publish must re-anchor",
                version,
                err,
                self._bucket_latest,
            )
            raise PublishFailedError(
                f"publishing version {version} failed: {type(err).__name__}: {err}; the bucket's "
                f"newest version is {self._bucket_latest}; continue with "
                "publish(..., anchor=True)"
            ) from err
        if self.on_report is not None:
            self.on_report(report)
        return report

    def _run(self, snap: _Snapshot, version: int, step: int | None, anchor: bool) -> PublishReport:
        t_start = time.perf_counter()
        if snap.ready is not None:
            snap.ready.synchronize()
        new = snap.state
        if self.settings.fp8:
            new = quantize_state(new, block_of(self.settings.fp8_block))
        base, base_version = self._base, self._last_version
        with_delta = base is not None and base_version is not None and not self._failed
        numel = sum(t.numel() for t in new.values())
        full_bytes = sum(t.numel() * t.element_size() for t in new.values())

        t0 = time.perf_counter()
        delta = None
        if with_delta:
            assert base is not None
            delta = compute_delta(base, new, base_version, version, self._base_digests)
            digests = {n: p.result_digest for n, p in delta.patches.items()}
        else:
            digests = state_digests(new)
        t1 = time.perf_counter()
        objects: list[NewObject] = []
        fmt = self.settings.format
        chain = fmt == "compact" and self.settings.chained_deltas
        delta_bytes = chained_bytes = None
        context = None  # of this version's delta, kept for the next one if the publish succeeds
        if delta is not None and base is not None:
            threads = self.settings.codec_threads
            positions = resolve_positions(self.settings.positions, numel)
            prev = self._context
            chained_job = None
            if chain and prev is not None and prev.version == base_version:
                # the chained encode runs next to the standalone one: their serial parts
                # (table choice, GIL hand-overs) overlap
                chained_job = self._chain_pool.submit(
                    encode_delta,
                    delta,
                    base,
                    fmt,
                    threads=threads,
                    context=prev,
                    positions=positions,
                )
            try:
                blob = encode_delta(delta, base, fmt, threads=threads, positions=positions)
            except BaseException:
                if chained_job is not None:  # it reads ``base``: let it finish first
                    futures_wait([chained_job])
                raise
            delta_bytes = len(blob)

            def delta_object(data: bytes, context_version: int | None = None) -> NewObject:
                assert delta is not None
                return NewObject(
                    "delta",
                    FORMAT_TAGS[fmt],
                    data,
                    base_version=base_version,
                    base_digest=delta.base_digest,
                    changed=delta.changed,
                    context_version=context_version,
                )

            objects.append(delta_object(blob))
            if chain:
                # before ``base`` is recycled as the next snapshot's buffers
                context = DeltaContext.of(delta, base)
            if chained_job is not None and prev is not None:
                chained = chained_job.result()
                if len(chained) < len(blob):  # else no replica would ever pick it
                    chained_bytes = len(chained)
                    objects.append(delta_object(chained, prev.base_version))
        t2 = time.perf_counter()
        with_anchor = anchor or delta is None or self._publisher.should_anchor(version)
        tmp: Path | None = None
        try:
            anchor_bytes = None
            if with_anchor:
                source, tmp = self._encode_anchor(new, version, digests, full_bytes)
                anchor_bytes = len(source) if isinstance(source, bytes) else source.stat().st_size
                compress = self.settings.anchor_compress
                fmt_tag = "safetensors+zstd" if compress else "safetensors"
                objects.insert(0, NewObject("anchor", fmt_tag, source))
            t3 = time.perf_counter()
            manifest = self._publisher.publish(
                version,
                objects,
                state_digest=combine_digests(digests),
                numel=numel,
                full_bytes=full_bytes,
                step=step,
            )
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        self._bucket_latest = version
        t4 = time.perf_counter()
        if self.register is not None:
            self.register(manifest)
        t5 = time.perf_counter()
        self._prove(new, version)
        t6 = time.perf_counter()

        # Success: the new state becomes the base; the old base's buffers are reused (after
        # any top-up reading the old one finished: it holds the lock while it reads).
        spare = _fp8_spare(snap.state, new, base) if self.settings.fp8 else base
        with self._proof_lock:
            self._spare, self._base, self._base_digests = spare, new, digests
            self._last_version, self._failed = version, False
        self._context = context
        report = PublishReport(
            version=version,
            step=step,
            base_version=base_version if delta is not None else None,
            anchor=with_anchor,
            delta_format=FORMAT_TAGS[fmt] if delta is not None else None,
            delta_bytes=delta_bytes,
            chained_bytes=chained_bytes,
            anchor_bytes=anchor_bytes,
            changed=delta.changed if delta is not None else None,
            numel=numel,
            full_bytes=full_bytes,
            snapshot_s=snap.snapshot_s,
            diff_s=t1 - t0,
            encode_s=t2 - t1,
            anchor_s=t3 - t2,
            upload_s=t4 - t3,
            register_s=t5 - t4,
            total_s=t5 - t_start,
            prove_s=t6 - t5,
        )
        logger.info(
            "version %d: %s, %.2f%% changed, %.3f s (diff %.3f, encode %.3f, anchor %.3f, "
            "upload %.3f, register %.3f)",
            version,
            ", ".join(
                f"{'chained ' if o.context_version is not None else ''}{o.kind} "
                f"{len(o.source) if isinstance(o.source, bytes) else 'file'}"
                for o in objects
            ),
            100 * (report.density or 0.0),
            report.total_s,
            report.diff_s,
            report.encode_s,
            report.anchor_s,
            report.upload_s,
            report.register_s,
        )
        return report

    def _prove(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Hand the version's weight challenges over: ``proof_challenges`` (or the pool size the
        coordinator aimed at for the previous version, when larger), then as many more as the
        coordinator's answer asks for (its fleet), in at most :data:`PROOF_ROUNDS` hand-overs
        and ``proof_challenges_max`` challenges. The version is already published and
        registered: a failure here costs only its proofs (workers stay unproven, later top-ups
        may still come), so it is logged, not raised."""
        first = self.settings.proof_challenges
        if self.challenges is None or first == 0:
            return
        spec = proof_spec(self.settings)
        count, done = max(first, self._proof_target), 0
        try:
            for round_ in range(PROOF_ROUNDS):
                count = min(count, self.settings.proof_challenges_max - done)
                if count <= 0:
                    break
                pairs = make_challenges(
                    state, version, spec, count, threads=proof_threads(self.settings)
                )
                result = self.challenges(version, spec, pairs)
                done += count
                count, target = pool_answer(result)
                if round_ == 0 and target:
                    self._proof_target = target
        except Exception as exc:
            logger.warning("version %d: weight challenges not handed over: %s", version, exc)
        finally:
            self._proofs = (version, done)

    def top_up(self) -> int:
        """Top the newest version's challenge pool up: ask ``challenge_need`` how many more
        the coordinator wants and hand them over, computed on the state this publisher holds
        (within ``proof_challenges_max`` per version). Returns how many were handed over. Runs
        every ``proof_topup_s`` in a background thread; safe to call from any thread."""
        need, hand_over = self.challenge_need, self.challenges
        if need is None or hand_over is None or not self.settings.proof_challenges:
            return 0
        with self._proof_lock:
            version, proofs = self._last_version, self._proofs
        if version is None or self._base is None:
            return 0
        done = proofs[1] if proofs is not None and proofs[0] == version else 0
        count = min(need(version), self.settings.proof_challenges_max - done)
        if count <= 0:
            return 0
        spec = proof_spec(self.settings)
        with self._proof_lock:  # the base cannot change (or be reused) while it is read
            if self._last_version != version or self._base is None:
                return 0  # a newer version was published meanwhile
            pairs = make_challenges(
                self._base, version, spec, count, threads=proof_threads(self.settings)
            )
            self._proofs = (version, done + count)
        hand_over(version, spec, pairs)
        logger.info("version %d: %d more weight challenges handed over", version, count)
        return count

    def _top_up_loop(self) -> None:
        while not self._top_up_stop.wait(self.settings.proof_topup_s):
            try:
                self.top_up()
            except Exception as exc:  # the coordinator may be restarting: try again later
                logger.warning("weight challenge top-up failed: %s", exc)

    def _encode_anchor(
        self, state: dict[str, torch.Tensor], version: int, digests: dict[str, str], size: int
    ) -> tuple[bytes | Path, Path | None]:
        compress = self.settings.anchor_compress
        if size <= self.settings.anchor_in_memory_max_bytes:
            return encode_anchor(state, version, compress, digests=digests), None
        suffix = ".safetensors.zst" if compress else ".safetensors"
        fd, name = tempfile.mkstemp(prefix=f"anchor-v{version}-", suffix=suffix, dir=self.tmp_dir)
        path = Path(name)
        try:
            with open(fd, "wb") as fh:
                write_anchor(fh, state, version, compress, digests=digests)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path, path


def _host_copy(src: torch.Tensor, dtype: torch.dtype, buf: torch.Tensor | None) -> torch.Tensor:
    """``src`` in ``dtype`` copied into ``buf`` (a host buffer of an earlier version, when it
    fits) or a new one. A CUDA tensor is cast on its device and copied asynchronously into
    pinned memory."""
    cuda = src.device.type == "cuda"
    if buf is None or buf.shape != src.shape or buf.dtype != dtype:
        buf = torch.empty(src.shape, dtype=dtype, pin_memory=cuda)
    buf.copy_(src.to(dtype) if cuda else src, non_blocking=cuda)
    return buf


def _fp8_spare(
    snapshot: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    old: Mapping[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """Snapshot buffers free for the next version once ``new`` (the fp8 state quantized from
    ``snapshot``) is the base: the bf16 buffers of quantized tensors, and for the tensors
    ``new`` keeps in bf16 (it holds the snapshot's buffers themselves) those of the previous
    base ``old``, which nothing reads any more."""
    spare: dict[str, torch.Tensor] = {}
    for name, buf in snapshot.items():
        if new.get(name) is not buf:
            spare[name] = buf
        elif old is not None and name in old and old[name] is not buf:
            spare[name] = old[name]
    return spare
