"""Keep an engine's weights bit-identical to the trainer's, pausing generation only to apply.

:class:`WeightSync` owns an engine's weights. It reads versions from the bucket
(:class:`~deltarl.weightsync.writer.BucketReader`), plans with the planner, and is the
:class:`~deltarl.rollout.engines.base.WeightsGate` the engine enters around every forward step.

Order of calls in :meth:`WeightSync.sync_to` (one sync at a time; generation runs concurrently
in other threads)::

    plan    = manifests (minus objects that failed here) -> cheapest plan current -> target
    for each step of the plan:
      delta:  check base (version + state digest) -> fetch (size + xxh3 checked) -> decode
              against the host mirror -> stage indices/values on the engine's device
              -> PAUSE: wait for the in-flight forward step, apply_staged, stamp (v, seq+1) -> RESUME
              -> verify the engine's tensors against the trainer's digests -> update the mirror
      anchor: fetch -> decode (every tensor digest checked) -> PAUSE: copy every tensor in,
              verify, stamp (v, seq+1) -> RESUME (recovery only, so verified inside the pause)
    a step that fails (missing or corrupt object, base mismatch, failed verification) is
    recorded; the plan is recomputed without it, from the current version if the weights are
    still good, else from nothing (an anchor); at most ``max_attempts`` plans per call. A
    failure that casts doubt on the local weights (verification fails; intact bytes that do
    not decode against them) makes them unhealthy, and the object is only excluded from
    later plans if it fails again after a fresh anchor.

Chained deltas (``ObjectRef.context_version`` set) decode only against the
:class:`~deltarl.weightsync.codec.context.DeltaContext` of the delta applied just before
them. The sync keeps that context of the last delta it applied and verified (built from the host
state after decoding, before the apply: ~10 bytes per changed element), plans with it (the
planner then uses chained objects only where they are valid) and drops it on an anchor load or
whenever the weights become unhealthy. A chained delta that refuses the context
(``ContextMismatchError``: nothing was decoded) leaves the weights healthy: the context is
dropped, the object excluded, and the re-plan uses standalone deltas.

Guarantees:

* Generation only ever runs with weights that are verified or pending verification of a delta
  applied on top of verified weights. Before the first anchor, after a failed verification and
  after an interrupted apply, :attr:`WeightSync.healthy` is false and every forward step raises
  :class:`WeightsUnhealthyError` (the reason is in :attr:`WeightSync.reason`), until a sync
  reloads verified weights.
* A sample may carry version ``v`` only if its tokens were sampled after ``v``'s apply; each
  :class:`~deltarl.rollout.engines.base.Completion` records the stamp of its first and its last
  token, so a generation that spans a sync records both versions (``version_min`` <
  ``version_max``; its early KV entries come from the older weights).
* Tokens sampled between an apply and its verification are *pending*: :meth:`WeightSync.check`
  says ``"verified"`` once the verification passed, ``"failed"`` if it did not (drop the sample),
  so nothing generated with bad weights need ever be submitted. ``verify_before_resume=True``
  verifies inside the pause instead (longer pause, no pending window).
* Versions never go back: a sync whose target is older than the newest version the engine
  has held (verified) aims at that version instead (a healthy engine does nothing; an
  unhealthy one reloads at least it), and a plan from verified weights uses no object of
  their version or older (no anchor of an older version). The reader under it refuses an
  older ``latest.json`` than one it accepted (``RollbackError``, weightsync/reader.py):
  the sync fails, the weights stay, the caller reports it and retries.
* The paused window is one store kernel launch per value bit width on CUDA (``apply_kernel``,
  addresses built at staging; see weightsync/apply_kernel.py), else one
  ``index_copy_`` per changed tensor, plus a device synchronize on CUDA; download, decode,
  staging and verification run while generation continues.

An engine whose weights are shards in other processes (the vllm engine at tensor parallelism >
1: :meth:`~deltarl.rollout.engines.base.Engine.sharded_weights`) keeps the same order through
its handle: staging sends each rank its slice, the pause is one apply call to every rank, and
verification patches the host mirror, checks it against the trainer's digests and every rank's
shards against it (docs/vllm.md, "Tensor parallelism").

Timings of every step are kept in :attr:`WeightSync.timings` (:class:`StepTiming`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, replace

import torch

from deltarl.rollout import fault_points
from deltarl.rollout.engines.base import Completion, Engine, SamplingParams, WeightsStamp
from deltarl.rollout.sync.decode_process import DecodeProcess, DecodeProcessError, SharedMirror
from deltarl.rollout.sync.records import (
    StepTiming,
    SyncError,
    SyncReport,
    SyncStatus,
    Verdict,
    WeightsUnhealthyError,
)
from deltarl.weightsync.anchor import decode_anchor
from deltarl.weightsync.codec.bits import bits_view
from deltarl.weightsync.codec.compact import default_threads, warm_up_decoder
from deltarl.weightsync.codec.context import DeltaContext
from deltarl.weightsync.codec.formats import FORMAT_TAGS, READ_ONLY_TAGS, decode_delta
from deltarl.weightsync.delta import (
    APPLY_KERNELS,
    UNKNOWN_DIGEST,
    Delta,
    apply_staged,
    scatter_patch,
    stage_delta,
)
from deltarl.weightsync.digest import combine_digests, state_digests
from deltarl.weightsync.errors import (
    BaseMismatchError,
    ContextMismatchError,
    CorruptDeltaError,
    DeltaError,
    StateMismatchError,
    VerificationError,
)
from deltarl.weightsync.fp8 import SCALE_SUFFIX
from deltarl.weightsync.manifest import ObjectRef, VersionManifest
from deltarl.weightsync.planner import CatchUpPlan, plan_catch_up
from deltarl.weightsync.proof import ProofSpec, proof_answer
from deltarl.weightsync.reader import BucketReader
from deltarl.weightsync.sharding import layout_view, merge_parts

logger = logging.getLogger(__name__)

# parts of a sharded delta decoded at once in process (sharing one pool of decoding threads)
PART_DECODERS = 4

ANCHOR_FORMATS = ("safetensors", "safetensors+zstd")
DEFAULT_FORMATS: tuple[str, ...] = (*FORMAT_TAGS.values(), *READ_ONLY_TAGS, *ANCHOR_FORMATS)
"""Object formats a worker can load: every delta format of the codec (those it writes and those
of older trainers it still decodes) and both anchor formats."""

__all__ = [
    "DEFAULT_FORMATS",
    "StepTiming",
    "SyncError",
    "SyncReport",
    "SyncStatus",
    "Verdict",
    "WeightSync",
    "WeightsUnhealthyError",
]


class WeightSync:
    """Follows the bucket's versions for one engine; see the module docstring for the protocol.

    ``formats``: object formats to plan with (default :data:`DEFAULT_FORMATS`).
    ``verify_before_resume``: verify deltas inside the pause (no pending window, longer pause).
    ``full_verify``: re-hash every tensor after a delta, not only the changed ones.
    ``host_mirror``: keep a CPU copy of the weights to decode against (None: only when the
    engine is not on the CPU; a CPU engine's own tensors serve as the mirror, no second copy).
    ``decode_threads``: threads of the compact decoder (None: its default).
    ``decode_process``: decode in a child process against a shared-memory host mirror
    (:mod:`~deltarl.rollout.sync.decode_process`), so that the engine's Python threads cannot slow
    decoding down through the GIL. Off by default: on an H200 box (16 cores) decoding in
    process took 0.50 s p50 next to generation, 0.63 s in the child (which adds copies); the
    child pays off where few cores are shared with a Python-heavy engine (2 cores: 0.9 s in the
    child vs 3.4-17 s in process next to a busy Python thread). Needs ``host_mirror``. Chained
    deltas decode in the child too: it keeps the contexts of the deltas it decoded itself (they
    never cross the pipe); one it lacks (a restarted child) means an in-process decode.
    ``apply_kernel``: how a delta is written inside the pause on CUDA (:data:`APPLY_KERNELS`):
    ``"auto"`` one Triton store launch per bit width where Triton runs (warmed up before the
    first anchor's pause), else one ``index_copy_`` per changed tensor; ``"triton"`` insists
    (ValueError here on a non-CUDA engine or without Triton); ``"torch"`` always ``index_copy_``.
    """

    def __init__(
        self,
        engine: Engine,
        reader: BucketReader,
        *,
        formats: Collection[str] | None = None,
        verify_before_resume: bool = False,
        full_verify: bool = False,
        host_mirror: bool | None = None,
        decode_threads: int | None = None,
        decode_process: bool = False,
        apply_kernel: str = "auto",
        max_attempts: int = 4,
        history: int = 1000,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if apply_kernel not in APPLY_KERNELS:
            raise ValueError(f"apply_kernel must be one of {APPLY_KERNELS}, got {apply_kernel!r}")
        if apply_kernel == "triton":
            from deltarl.weightsync import apply_kernel as kernel_module

            kernel_module.use_kernel("triton", engine.device)  # raises where it cannot run
        self.apply_kernel = apply_kernel
        self.engine = engine
        self.reader = reader
        self.formats = tuple(formats) if formats is not None else DEFAULT_FORMATS
        self.verify_before_resume = verify_before_resume
        self.full_verify = full_verify
        self.host_mirror = engine.device.type != "cpu" if host_mirror is None else host_mirror
        # an engine whose weights are shards in other processes (vLLM at TP > 1): staged,
        # applied and verified through this handle, against the host mirror
        # (engines written against the protocol without subclassing Engine have no such hook)
        sharded = getattr(engine, "sharded_weights", None)
        self._shards = sharded() if sharded is not None else None
        if self._shards is not None:
            if host_mirror is False:
                raise ValueError(
                    "a sharded engine needs the host mirror (shards verify against it)"
                )
            self.host_mirror = True
        self.decode_threads = decode_threads
        use_process = decode_process
        if use_process and not self.host_mirror:
            raise ValueError("decode_process needs host_mirror: the child decodes against it")
        self._decoder = DecodeProcess(decode_threads) if use_process else None
        self._shared: SharedMirror | None = None  # the mirror's shared block (with _decoder)
        self.max_attempts = max_attempts
        self.timings: deque[StepTiming] = deque(maxlen=history)
        # gate state (guarded by _cond)
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._healthy = False
        self._reason = "no weights loaded yet: sync_to() loads the latest anchor"
        self._stamp = WeightsStamp(version=None, seq=0)
        self._verified_seq = 0
        self._failed_seqs: set[int] = {0}
        # sync state (only touched under _sync_lock)
        self._sync_lock = threading.Lock()
        self._version: int | None = None  # verified version held by the engine
        self._highest: int | None = None  # newest version ever verified here (never goes back)
        self._digests: dict[str, str] = {}  # tensor digests of the engine's weights at _version
        self._verified_state: tuple[int, str] | None = None  # (_version, its state digest)
        self._mirror: dict[str, torch.Tensor] | None = None  # CPU copy at _version, if host_mirror
        self._layout: tuple[str, ...] | None = None  # sharded layout of _version (None: unsharded)
        self._bad_keys: set[str] = set()  # objects never to plan with again
        # what the last applied and verified delta changed (chained deltas decode against it)
        self._context: DeltaContext | None = None
        self._suspects: set[str] = set()  # objects that failed once
        self._executor: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ gate and status

    @contextmanager
    def forward(self) -> Iterator[WeightsStamp]:
        """Enter around one forward step: waits out an apply, refuses unhealthy weights."""
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            if not self._healthy:
                raise WeightsUnhealthyError(f"refusing to generate: {self._reason}")
            self._readers += 1
            stamp = self._stamp
        try:
            yield stamp
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def _exclusive(self) -> Iterator[float]:
        """Pause generation (writer priority: new forward steps wait); yields the wait time."""
        t0 = time.perf_counter()
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True
        # Forward steps already launched on the device (an engine that schedules ahead, e.g.
        # vLLM with async scheduling) finish on the weights they were launched with: the
        # device is drained before anything is written (counted as waiting, not as pause).
        self._sync_device()
        # No garbage collection inside the pause: a full collection of a process holding a
        # model's object graph takes milliseconds, longer than the apply itself.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            yield time.perf_counter() - t0
        finally:
            if gc_was_enabled:
                gc.enable()
            with self._cond:
                self._writer = False
                self._cond.notify_all()

    def _set_unhealthy(self, reason: str, seq: int | None = None) -> None:
        self._context = None  # chained deltas only ever build on verified weights
        with self._cond:
            self._healthy = False
            self._reason = reason
            if seq is not None:
                self._failed_seqs.add(seq)
        logger.error("weights unhealthy: %s", reason)

    @property
    def healthy(self) -> bool:
        """False while generation is refused (no weights, failed verification, broken apply)."""
        with self._cond:
            return self._healthy

    @property
    def reason(self) -> str:
        """``"ok"`` or why the weights are unhealthy."""
        with self._cond:
            return self._reason

    @property
    def version(self) -> int | None:
        """Newest verified version held by the engine (None: none)."""
        return self._version

    def verified_digest(self) -> tuple[int, str] | None:
        """``(version, state digest)`` of the newest verified weights (one atomic read, for
        heartbeats); None before the first. It stays set while :attr:`healthy` is false: check
        that first."""
        return self._verified_state

    def status(self) -> SyncStatus:
        with self._cond:
            return SyncStatus(
                version=self._stamp.version,
                verified_version=self._version,
                healthy=self._healthy,
                reason=self._reason,
                seq=self._stamp.seq,
            )

    def prove(self, version: int, nonce: bytes, spec: ProofSpec) -> str | None:
        """The answer to a weight challenge (:mod:`deltarl.weightsync.proof`), computed
        on the tensors the engine serves right now, without pausing generation (it only reads).
        None when the served weights are not verified weights of ``version`` or changed while
        they were read (an apply bumps the stamp): the next challenge is for the new version."""
        with self._cond:
            stamp = self._stamp
            current = (
                self._healthy
                and not self._writer
                and stamp.version == version
                and self._verified_seq == stamp.seq
            )
        if not current:
            return None
        # sharded: the host mirror, which equalled every rank's shards at the last verification
        served = self.engine.named_parameters() if self._shards is None else self._mirror
        if served is None:
            return None
        answer = proof_answer(served, nonce, version, spec)
        with self._cond:
            if self._writer or self._stamp.seq != stamp.seq or not self._healthy:
                return None
        return answer

    def check(self, completion: Completion) -> Verdict:
        """Whether every weight state that sampled ``completion`` passed verification.

        ``"pending"``: a verification it depends on has not finished (ask again after the sync
        returns); ``"failed"``: some of its tokens came from weights that failed verification
        (or from no managed weights at all): drop it.
        """
        lo, hi = completion.first.seq, completion.last.seq
        with self._cond:
            if any(lo <= s <= hi for s in self._failed_seqs):
                return "failed"
            return "pending" if hi > self._verified_seq else "verified"

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        routing_from: Sequence[int] | None = None,
    ) -> list[Completion]:
        """``engine.generate`` gated by this sync (raises :class:`WeightsUnhealthyError`)."""
        if routing_from is None:
            return self.engine.generate(prompts, params, gate=self)
        return self.engine.generate(prompts, params, gate=self, routing_from=routing_from)

    # ------------------------------------------------------------------ sync

    def sync_in_background(self, target: int | None = None) -> Future[SyncReport]:
        """Run :meth:`sync_to` on this object's own sync thread; returns its future."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="weightsync")
        return self._executor.submit(self.sync_to, target)

    def close(self) -> None:
        """Stop the background sync thread (waits for a running sync) and the decoding child."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._sync_lock:
            if self._decoder is not None:
                self._decoder.close()
            self._drop_shared()

    def _drop_shared(self) -> None:
        """Forget the shared mirror block (the child stops using it at its next attach)."""
        if self._shared is not None:
            if self._mirror is self._shared.tensors:
                self._mirror = None
            self._shared.close()
            self._shared = None

    def sync_to(self, target: int | None = None) -> SyncReport:
        """Bring the engine to ``target`` (default: the latest published version).

        Blocking (call it from a sync thread, or use :meth:`sync_in_background`); generation in
        other threads is paused only while each object is applied. A target at or below the
        verified version is a no-op (versions only move forward); one older than the newest
        version ever verified here becomes that version. Raises :class:`SyncError`
        when no plan reaches the target within ``max_attempts`` tries (the weights stay at the
        last verified version if :attr:`healthy`), ``StateMismatchError`` when the bucket's
        tensors are not the engine's (wrong model). Bucket errors (network, permissions)
        propagate unchanged: the weights are untouched unless the error hit the apply (then
        :attr:`healthy` is false); call again later.
        """
        with self._sync_lock:
            latest = self.reader.latest_version()
            if latest is None:
                raise SyncError(f"nothing is published in {self.reader.bucket.uri} yet")
            target = latest if target is None else target
            if target > latest:
                raise SyncError(
                    f"version {target} is not published yet (latest: {latest}; if this persists "
                    "while the coordinator announces it, an older latest.json may have been put "
                    "back in the bucket)"
                )
            if self._highest is not None and target < self._highest:
                if not self.healthy:
                    logger.warning(
                        "sync to v%d: not going back from v%d; reloading v%d",
                        target,
                        self._highest,
                        self._highest,
                    )
                target = self._highest
            report = SyncReport(start_version=self._version, target=target)
            if self.healthy and self._version is not None and target <= self._version:
                report.version = self._version
                return report
            fetched0 = self.reader.fetched_bytes
            try:
                return self._sync(target, report)
            finally:
                report.downloaded_bytes = self.reader.fetched_bytes - fetched0
                logger.info(
                    "sync v%s -> v%d: planned %d bytes, downloaded %d bytes, %d failure(s)",
                    report.start_version,
                    target,
                    report.planned_bytes,
                    report.downloaded_bytes,
                    len(report.failures),
                )

    def _sync(self, target: int, report: SyncReport) -> SyncReport:
        """The attempts of :meth:`sync_to` (under the sync lock)."""
        for _ in range(self.max_attempts):
            if self.healthy and self._version == target:
                break
            plan = self._plan(target, report)
            report.planned_bytes += plan.total_bytes
            for ref in plan.steps:
                try:
                    self._apply_ref(ref, report)
                except StateMismatchError:
                    raise
                except DeltaError as err:
                    report.failures.append(f"{ref.kind} {ref.key} (v{ref.version}): {err}")
                    logger.warning(
                        "sync to v%d: %s %s failed (%s); planning around it",
                        target,
                        ref.kind,
                        ref.key,
                        err,
                    )
                    # A failure that left the weights unhealthy may be their fault (drift):
                    # the object is only excluded if it fails again after a fresh anchor.
                    if self.healthy or ref.key in self._suspects:
                        self._bad_keys.add(ref.key)
                    self._suspects.add(ref.key)
                    break
        report.version = self._version
        if not (self.healthy and self._version == target):
            where = f"at v{self._version}" if self.healthy else "unhealthy"
            raise SyncError(
                f"could not reach version {target} in {self.max_attempts} attempts (weights "
                f"{where}); failures: {report.failures}"
            )
        return report

    def _plan(self, target: int, report: SyncReport) -> CatchUpPlan:
        current = self._version if self.healthy else None
        manifests: dict[int, VersionManifest] = self.reader.manifests()
        if current is not None:  # never back: nothing of the version held or older
            manifests = {v: m for v, m in manifests.items() if v > current}
        if self._bad_keys:
            manifests = {
                v: m.model_copy(
                    update={"objects": tuple(o for o in m.objects if o.key not in self._bad_keys)}
                )
                for v, m in manifests.items()
            }
        context = self._held_context()
        try:
            return plan_catch_up(
                manifests,
                current,
                target,
                formats=self.formats,
                context=None if context is None else context.base_version,
            )
        except ValueError as err:
            report.version = self._version
            raise SyncError(
                f"no way to version {target} from {current}: {err}; failures: {report.failures}"
            ) from err

    def _apply_ref(self, ref: ObjectRef, report: SyncReport) -> None:
        created = self._created_at(ref.version)
        if ref.kind == "anchor":
            timing = self._load_anchor(ref, created)
        else:
            timing = self._apply_delta(ref, created)
        report.steps.append(timing)
        self.timings.append(timing)
        logger.info(
            "weights at v%d via %s (%d bytes): paused %.2f ms, download %.1f ms, decode %.1f ms, "
            "verify %.1f ms",
            ref.version,
            ref.kind,
            ref.size,
            timing.pause_s * 1e3,
            timing.download_s * 1e3,
            timing.decode_s * 1e3,
            timing.verify_s * 1e3,
        )

    def _created_at(self, version: int) -> float | None:
        try:
            return self.reader.manifest(version).created_at.timestamp()
        except ValueError:
            return None

    def _held_context(self) -> DeltaContext | None:
        """The context of the delta that brought the verified weights to their version (None:
        they came from an anchor, or it is unknown)."""
        ctx = self._context
        if ctx is None or not self.healthy or ctx.version != self._version:
            return None
        return ctx

    def _context_of(self, delta: Delta, ref: ObjectRef) -> DeltaContext | None:
        """The context of ``delta`` (read from the host state, before it is applied), for the
        chained delta that may follow it; None where no chained delta could use it."""
        if FORMAT_TAGS["compact"] not in self.formats:
            return None  # chained deltas are compact ones
        try:
            ctx = DeltaContext.of(delta, self._host_state())
        except (ValueError, KeyError, TypeError, RuntimeError) as err:  # an optimization only
            logger.warning("no delta context for v%d (%s): no chained delta next", ref.version, err)
            return None
        # the manifest's versions (a TRL delta may not record its own)
        return replace(ctx, base_version=ref.base_version, version=ref.version)

    @property
    def _pinned_changes(self) -> bool:
        """Whether a delta decoded here lands in pinned buffers that staging copies to the
        engine's GPU as they lie (one engine on CUDA; a sharded engine slices per rank)."""
        return self._shards is None and self.engine.device.type == "cuda"

    def _host_state(self) -> Mapping[str, torch.Tensor]:
        return self._mirror if self._mirror is not None else self.engine.named_parameters()

    def _sync_device(self) -> None:
        if self._shards is not None:
            return  # each rank drains its own device inside the apply call
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def _apply_delta(self, ref: ObjectRef, created: float | None) -> StepTiming:
        if not self.healthy or self._version != ref.base_version:
            raise BaseMismatchError(
                f"delta {ref.base_version} -> {ref.version} does not start at the engine's "
                f"verified version {self._version if self.healthy else None}"
            )
        if ref.layout != self._layout:
            raise BaseMismatchError(
                f"delta {ref.base_version} -> {ref.version} is laid out for another sharding "
                "than the engine's weights (a trainer that changed its world size): an anchor"
            )
        if ref.base_digest != combine_digests(self._digests):
            raise BaseMismatchError(
                f"delta {ref.base_version} -> {ref.version}: the engine's state digest is not "
                "the delta's base digest"
            )
        # only a chained delta needs the context (standalone ones ignore it; in the child they
        # must not wait for a context it may not hold)
        context = self._held_context() if ref.context_version is not None else None
        t0 = time.perf_counter()
        data = self.reader.fetch(ref) if ref.parts is None else b""
        t1 = time.perf_counter()
        try:
            if ref.parts is None:
                delta = self._decode(data, context)
            else:  # parts are decoded as they arrive: download_s is the time spent waiting
                delta, waited = self._decode_parts(ref)
                t1 = t0 + waited
        except ContextMismatchError:
            # Nothing was decoded: the weights are fine, but this context is not the one the
            # bucket chains on. Forget it: the next plan uses standalone deltas.
            self._context = None
            raise
        except CorruptDeltaError as err:
            # The bytes passed the manifest's size and xxh3 check, so a decode that fails is
            # evidence against the local weights it decodes against (compact codes values
            # relative to them): distrust them until an anchor is reloaded.
            reason = (
                f"delta v{ref.base_version} -> v{ref.version} (intact bytes) does not decode "
                f"against the local weights, which may have drifted: {err}"
            )
            self._set_unhealthy(reason)
            raise CorruptDeltaError(reason) from err
        _check_delta_versions(delta, ref)
        # The context (for a chained delta next) reads the changed elements' old values. A host
        # mirror keeps them until it is patched after verification: built then, it stays off
        # the path to applied; an engine's own tensors lose them in the pause: built now.
        late_context = self._mirror is not None and self._shards is None
        new_context = None
        if ref.parts is None and not late_context:
            new_context = self._context_of(delta, ref)
        t2 = time.perf_counter()
        fault_points.hold("before_apply", version=ref.version, base_version=ref.base_version)
        if self._shards is not None:
            _refuse_layout_on_shards(ref)
            params: Mapping[str, torch.Tensor] = {}
            staged = None
            self._shards.stage(delta, ref.version)  # sliced per rank, staged on every GPU
        else:
            params = self._params(ref.layout)
            # binding the target tensors now (checked: names, dtypes, shapes, device) leaves
            # only the scatters for the pause
            staged = stage_delta(delta, self.engine.device, params, kernel=self.apply_kernel)
        t3 = time.perf_counter()
        seq = self._stamp.seq + 1
        verify_s = 0.0
        digests: dict[str, str] | None = None
        with self._exclusive() as wait_s:
            tp = time.perf_counter()
            try:
                if staged is None:
                    assert self._shards is not None
                    applied_by = self._shards.apply(ref.version)
                else:
                    applied_by = apply_staged(params, staged)
                self._sync_device()
            except BaseException as err:
                self._set_unhealthy(f"apply of v{ref.version} was interrupted: {err}", seq)
                raise
            with self._cond:
                self._stamp = WeightsStamp(ref.version, seq)
            if self.verify_before_resume:
                digests = self._verify(delta, ref, seq)
                verify_s = time.perf_counter() - tp
            pause_s = time.perf_counter() - tp
        applied = time.time()
        if digests is None:
            tv = time.perf_counter()
            digests = self._verify(delta, ref, seq)
            verify_s = time.perf_counter() - tv
        verified = time.time()
        self._version, self._digests = ref.version, digests
        self._highest = max(ref.version, self._highest or 0)
        self._verified_state = (ref.version, combine_digests(digests))
        if ref.parts is None and late_context:
            new_context = self._context_of(delta, ref)  # the mirror is still at the base
        self._context = new_context if ref.parts is None else None
        with self._cond:
            self._verified_seq = seq
        tm = time.perf_counter()
        if self._mirror is not None and self._shards is None:
            try:
                mirror = layout_view(self._mirror, ref.layout)
                for patch in delta.patches.values():
                    scatter_patch(mirror[patch.name], patch)
            except BaseException:
                # half-patched: decode against the engine's tensors (in process) instead
                self._drop_shared()
                self._mirror = None
                raise
        return StepTiming(
            version=ref.version,
            base_version=ref.base_version,
            kind="delta",
            format=ref.format,
            bytes=ref.size,
            changed=delta.changed,
            download_s=t1 - t0,
            decode_s=t2 - t1,
            stage_s=t3 - t2,
            wait_s=wait_s,
            pause_s=pause_s,
            verify_s=verify_s,
            mirror_s=time.perf_counter() - tm,
            publish_to_applied_s=None if created is None else applied - created,
            publish_to_verified_s=None if created is None else verified - created,
            chained=ref.context_version is not None,
            apply=applied_by,
        )

    def _decode(self, data: bytes, context: DeltaContext | None) -> Delta:
        """Decode against the host state: in the child when there is one (and it holds
        ``context``, which it keeps itself: the arrays never cross the pipe), else here."""
        if self._decoder is not None and self._shared is not None:
            if context is None or self._decoder.holds(context):
                try:
                    return self._decoder.decode(data, self._digests, context=context)
                except DecodeProcessError as err:
                    logger.warning("decoding child failed (%s); decoding in process this time", err)
            else:
                logger.info("decoding child lacks the delta context; decoding in process")
        return decode_delta(
            data,
            self._host_state(),
            check_base=True,
            base_digests=self._digests,
            threads=self.decode_threads,
            context=context,
            pinned=self._pinned_changes,
        )

    def _params(self, layout: tuple[str, ...] | None) -> Mapping[str, torch.Tensor]:
        """The engine's tensors, as row views under a sharded ``layout`` (:mod:`deltarl.weightsync.sharding`)."""
        return layout_view(self.engine.named_parameters(), layout)

    def _decode_parts(self, ref: ObjectRef) -> tuple[Delta, float]:
        """A sharded delta: its parts fetched in parallel and decoded as they arrive, against
        the host state's row views; merged into one delta over the layout. In process, up to
        :data:`PART_DECODERS` parts decode at once on one pool of decoding threads (one
        part's reading of headers overlaps another's compiled decode); in the decoding child
        one at a time.
        Also returns the seconds spent waiting for parts (not decoding)."""
        layout = ref.layout
        assert layout is not None
        host = layout_view(self._host_state(), layout)
        waited = 0.0
        in_child = self._decoder is not None and self._shared is not None
        futures: list[Future[Delta]] = []
        with contextlib.ExitStack() as stack:
            pool = None
            if not in_child:
                pool = stack.enter_context(
                    ThreadPoolExecutor(
                        self.decode_threads or default_threads(), thread_name_prefix="decode"
                    )
                )
            parts_pool = stack.enter_context(
                ThreadPoolExecutor(1 if in_child else PART_DECODERS, thread_name_prefix="part")
            )
            parts = self.reader.fetch_parts(ref)
            try:
                while True:
                    tw = time.perf_counter()
                    item = next(parts, None)
                    waited += time.perf_counter() - tw
                    if item is None:
                        break
                    part, data = item
                    missing = [k for k in part.slices if k not in self._digests]
                    if missing:
                        raise BaseMismatchError(f"the engine holds no digest of {missing[:3]}")
                    digests = {k: self._digests[k] for k in part.slices}
                    futures.append(
                        parts_pool.submit(self._decode_part, data, digests, host, layout, pool)
                    )
                delta = merge_parts((f.result() for f in futures), layout)
            except BaseException:
                for f in futures:  # a failed part: the others not started are not decoded
                    f.cancel()
                raise
            finally:
                parts.close()  # a failed part: cancel the downloads not started yet
        return delta, waited

    def _decode_part(
        self,
        data: bytes,
        digests: Mapping[str, str],
        host: Mapping[str, torch.Tensor],
        layout: tuple[str, ...],
        pool: Executor | None = None,
    ) -> Delta:
        """One part of a sharded version, against its slices (named by ``digests``): in the
        child when there is one (its own GIL, as for whole deltas), else here (on ``pool``)."""
        if self._decoder is not None and self._shared is not None:
            try:
                return self._decoder.decode(data, digests, layout=layout)
            except DecodeProcessError as err:
                logger.warning("decoding child failed (%s); decoding in process this time", err)
        return decode_delta(
            data,
            {k: host[k] for k in digests},
            check_base=True,
            base_digests=digests,
            threads=self.decode_threads,
            pinned=self._pinned_changes,
            pool=pool,
        )

    def _verify(self, delta: Delta, ref: ObjectRef, seq: int) -> dict[str, str]:
        """Digests of the engine's tensors after applying ``delta``; unhealthy on mismatch.

        Sharded engine: the host mirror is patched first and checked against the trainer's
        digests, then every rank's shards against the same boxes of the mirror."""
        if self._shards is not None:
            assert self._mirror is not None
            try:
                for patch in delta.patches.values():
                    scatter_patch(self._mirror[patch.name], patch)
            except BaseException as err:
                self._set_unhealthy(f"host mirror of v{ref.version} half-patched: {err}", seq)
                raise
            params: Mapping[str, torch.Tensor] = self._mirror
        else:
            params = self._params(ref.layout)
        digests = dict(self._digests)
        try:
            digests.update(
                state_digests(
                    {
                        name: params[name]
                        for name, p in delta.patches.items()
                        if self.full_verify or p.changed or p.base_digest != p.result_digest
                    }
                )
            )
        except BaseException as err:  # the applied state must not stay "pending" forever
            self._set_unhealthy(f"verification of v{ref.version} could not complete: {err}", seq)
            raise
        bad = [
            n
            for n, p in delta.patches.items()
            if p.result_digest != UNKNOWN_DIGEST and digests[n] != p.result_digest
        ]
        if bad or combine_digests(digests) != ref.result_digest:
            what = f"{len(bad)} tensor(s) differ, e.g. {bad[:3]}" if bad else "state digest differs"
            reason = (
                f"verification of v{ref.version} failed ({what}): the engine's weights are not "
                "the trainer's; reloading an anchor"
            )
            self._set_unhealthy(reason, seq)
            raise VerificationError(reason)
        if self._shards is not None:
            self._verify_shards([n for n in delta.patches if n in digests], ref, seq)
        return digests

    def _verify_shards(self, names: list[str], ref: ObjectRef, seq: int) -> None:
        """Every rank's shards of ``names`` equal the verified host mirror; unhealthy if not."""
        assert self._shards is not None and self._mirror is not None
        try:
            bad = self._shards.mismatches(names, self._mirror)
        except BaseException as err:
            self._set_unhealthy(f"shard verification of v{ref.version} failed: {err}", seq)
            raise
        if bad:
            reason = (
                f"verification of v{ref.version} failed: {len(bad)} GPU shard(s) differ from "
                f"the verified host state, e.g. {bad[:3]}; reloading an anchor"
            )
            self._set_unhealthy(reason, seq)
            raise VerificationError(reason)

    def _load_anchor(self, ref: ObjectRef, created: float | None) -> StepTiming:
        t0 = time.perf_counter()
        if ref.parts is None:
            state, version, digests = decode_anchor(self.reader.fetch(ref))
        else:  # a sharded anchor: every part's rows, decoded as they arrive
            state, digests, version = {}, {}, ref.version
            for part, data in self.reader.fetch_parts(ref):
                rows, part_version, digs = decode_anchor(data)
                if set(rows) != set(part.slices) or part_version != ref.version:
                    raise CorruptDeltaError(f"anchor part {part.key} does not hold its slices")
                state.update(rows)
                digests.update(digs)
        t1 = time.perf_counter()
        if version != ref.version or combine_digests(digests) != ref.result_digest:
            raise CorruptDeltaError(
                f"anchor {ref.key} holds version {version} with another state digest than the "
                f"manifest's version {ref.version}"
            )
        shards = self._shards
        if shards is not None:
            _refuse_layout_on_shards(ref)
        params = shards.meta() if shards is not None else self._params(ref.layout)
        _check_same_tensors(params, state)
        t2 = time.perf_counter()
        seq = self._stamp.seq + 1
        self._context = None  # the weights are about to come from an anchor, not a delta
        if shards is not None:
            shards.stage_anchor(state, ref.version)  # every rank's boxes on its GPU, unpaused
        else:
            self._warm_apply_kernel(params)  # outside the pause: the first launch compiles
        if self._decoder is None:
            _warm_decoder()  # the first delta's decode would compile the decoder's kernels
        with self._exclusive() as wait_s:
            tp = time.perf_counter()
            try:
                if shards is not None:
                    shards.apply(ref.version)
                    bad = shards.mismatches(list(state), state)  # state's digests are checked
                else:
                    with torch.no_grad():
                        for name, t in params.items():
                            t.copy_(state[name])
                    _warm_scatter(params)
                    self._sync_device()
                    got = state_digests(params)
                    bad = [n for n in got if got[n] != digests[n]]
            except BaseException as err:
                self._set_unhealthy(f"load of anchor v{ref.version} was interrupted: {err}", seq)
                raise
            if bad:
                reason = f"anchor v{ref.version} did not load faithfully: {bad[:3]} differ"
                self._set_unhealthy(reason, seq)
                raise VerificationError(reason)
            with self._cond:
                self._stamp = WeightsStamp(ref.version, seq)
                self._verified_seq = seq
                self._healthy, self._reason = True, "ok"
            pause_s = time.perf_counter() - tp
        done = time.time()
        self._version, self._digests = ref.version, digests
        self._highest = max(ref.version, self._highest or 0)
        self._verified_state = (ref.version, combine_digests(digests))
        self._layout = ref.layout
        self._drop_shared()
        self._mirror = state if self.host_mirror else None
        if self._decoder is not None:  # a sharded anchor's mirror is keyed by its row slices
            shared = SharedMirror(state)
            try:
                self._decoder.attach(shared)
            except (DecodeProcessError, DeltaError) as err:
                logger.warning("decoding child cannot map the mirror (%s); decoding here", err)
                shared.close()
            else:
                self._shared, self._mirror = shared, shared.tensors
        return StepTiming(
            version=ref.version,
            base_version=None,
            kind="anchor",
            format=ref.format,
            bytes=ref.size,
            changed=None,
            download_s=t1 - t0,
            decode_s=t2 - t1,
            stage_s=0.0,
            wait_s=wait_s,
            pause_s=pause_s,
            verify_s=pause_s,
            mirror_s=0.0,
            publish_to_applied_s=None if created is None else done - created,
            publish_to_verified_s=None if created is None else done - created,
        )

    def _warm_apply_kernel(self, params: Mapping[str, torch.Tensor]) -> None:
        """Compile and load the store kernel for the engine's bit widths now, outside any pause
        (a no-op once done, or where the kernel is not used)."""
        device = self.engine.device
        if self.apply_kernel == "torch" or device.type != "cuda":
            return
        from deltarl.weightsync import apply_kernel as kernel_module

        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if kernel_module.use_kernel(self.apply_kernel, device):
            widths = {bits_view(t).dtype for t in params.values() if t.numel()}
            kernel_module.warm_up(device, widths)

    def timing_summary(self) -> dict[str, dict[str, float]]:
        """p50 / p99 / max of every timing field over the kept delta steps (seconds)."""
        rows = [asdict(t) for t in self.timings if t.kind == "delta"]
        out: dict[str, dict[str, float]] = {}
        for key in ("download_s", "decode_s", "stage_s", "wait_s", "pause_s", "verify_s"):
            values = sorted(float(r[key]) for r in rows)
            if values:
                out[key] = {
                    "p50": statistics.median(values),
                    "p99": values[min(len(values) - 1, round(0.99 * (len(values) - 1)))],
                    "max": values[-1],
                }
        return out


def _warm_scatter(params: Mapping[str, torch.Tensor]) -> None:
    """One ``index_copy_`` per bit width, writing an element's own bits back (no change), so
    that the first delta's pause does not include loading the scatter kernel (CUDA loads
    kernels lazily: that first load was an 8-18 ms pause on an H200)."""
    seen: set[torch.dtype] = set()
    with torch.no_grad():
        for t in params.values():
            flat = bits_view(t)
            if flat.dtype in seen or flat.numel() == 0:
                continue
            seen.add(flat.dtype)
            idx = torch.zeros(1, dtype=torch.int64, device=flat.device)
            flat.index_copy_(0, idx, flat[:1].clone())


def _check_delta_versions(delta: Delta, ref: ObjectRef) -> None:
    """A delta's own versions (when it records them) must be the manifest's."""
    if (delta.version is not None and delta.version != ref.version) or (
        delta.base_version is not None and delta.base_version != ref.base_version
    ):
        raise CorruptDeltaError(
            f"{ref.key} holds delta {delta.base_version} -> {delta.version}, the manifest says "
            f"{ref.base_version} -> {ref.version}"
        )


def _check_same_tensors(
    params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]
) -> None:
    """Refuse an anchor whose tensors are not exactly the engine's (names, dtypes, shapes)."""
    missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    differ = [
        n
        for n in sorted(set(params) & set(state))
        if params[n].dtype != state[n].dtype or params[n].shape != state[n].shape
    ]
    wrong = [
        f"{n}: engine {params[n].dtype}{list(params[n].shape)}, anchor "
        f"{state[n].dtype}{list(state[n].shape)}"
        for n in differ
    ]
    if missing or extra or wrong:
        fp8 = [
            side
            for side, tensors in (("bucket", state), ("engine", params))
            if any(t.dtype == torch.float8_e4m3fn for t in tensors.values())
        ]
        hint = " (same model and dtype on both sides?)"
        if len(fp8) == 1:
            hint = (
                f" (the {fp8[0]} holds block fp8: a trainer with publish.fp8 needs fp8 workers "
                "of the same model, [run] fp8 in a run config, docs/vllm.md)"
            )
        elif fp8 and all(n.endswith(SCALE_SUFFIX) for n in differ) and not missing + extra:
            hint = " (both hold block fp8 with different scale shapes: the same fp8_block?)"
        raise StateMismatchError(
            f"the bucket's model is not the engine's: anchor lacks {missing[:5]}, has extra "
            f"{extra[:5]}, mismatched {wrong[:3]}{hint}"
        )


def _refuse_layout_on_shards(ref: ObjectRef) -> None:
    """A tensor-parallel engine (weights split over ranks) cannot follow a version published
    in row parts by an FSDP trainer yet: its per-rank slicing works on whole tensors."""
    if ref.layout is not None:
        raise ValueError(
            f"v{ref.version} is published in row parts (an FSDP trainer) and this engine is "
            "tensor-parallel: following sharded versions needs tensor_parallel_size = 1"
        )


def _warm_decoder() -> None:
    """Compile the delta decoder's kernels (once per process): an optimization only."""
    try:
        warm_up_decoder()
    except Exception:  # the first delta compiles them instead
        logger.warning("warming up the delta decoder failed", exc_info=True)
