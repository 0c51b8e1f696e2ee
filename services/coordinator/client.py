"""The typed client of the coordinator: :class:`CoordinatorClient` (sync) and
:class:`AsyncCoordinatorClient` (asyncio), same methods, same answers.

Imports only httpx and the wire schemas (never the server modules, never fastapi or torch).
Every answer's status code is checked: anything but the expected 2xx raises
:class:`CoordinatorError` with the server's error code and message; bodies are validated with
``Model.model_validate``. Calls that are safe to repeat (everything except ``lease``) are retried
on connection errors and 502/503/504, with the clients' one back-off policy
(:class:`~deltarl.services.common.retry.Backoff`, from 0.1 s); ``submit`` is safe because of the
group's idempotency key, ``publish_version`` because an identical re-publish is accepted.
A *refused* connection (nothing listening: the coordinator is restarting) never reached a
server, so every call, ``lease`` included, waits for it with backoff for up to
``refused_wait_s`` (30 s by default; not with ``retries=0``), which rides out a restart.

Example (a worker)::

    with CoordinatorClient("http://coord:8700", token=WORKER_TOKEN) as c:
        ack = c.register(WorkerRegistration(worker_id="w1", engine="vllm", model=m, capacity=8))
        c.heartbeat("w1", WorkerHeartbeat(applied_version=ack.latest_version))
        c.submit(group)  # a TrajectoryGroup
        for record in c.iter_version_events(after=ack.latest_version):
            ...  # plan the catch-up to record.version from the bucket (weightsync/planner.py)
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter

from deltarl.services.common.client_headers import client_headers
from deltarl.services.common.retry import Backoff
from deltarl.services.common.tls import client_verify
from deltarl.services.coordinator.schemas import (
    AckRequest,
    AckResult,
    AdmissionRequest,
    AdmissionResponse,
    ChallengePool,
    ChallengePoolResult,
    ChallengePoolStatus,
    DeadLetterList,
    GroupRejection,
    Health,
    HeartbeatAck,
    LeasedBatch,
    LeaseExtension,
    ModelLimits,
    ProofAnswer,
    ProofResult,
    StatusSummary,
    SubmitResult,
    TrajectoryGroup,
    VersionManifest,
    VersionPublish,
    VersionRecord,
    WorkerHeartbeat,
    WorkerInfo,
    WorkerRegistration,
    decode_leased_batch,
    encode_group,
)

T = TypeVar("T")
MSGPACK = "application/msgpack"
_RETRY_STATUS = {502, 503, 504}


def _refused(exc: BaseException) -> bool:
    """True when the connection was refused (no server listening): the request was never
    sent, so repeating any call is safe. TLS failures and resets are not refusals."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, ConnectionRefusedError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return isinstance(exc, httpx.ConnectError) and "Connection refused" in str(exc)


# Waits of the clients' one back-off policy (services/common/retry.py): after a failed attempt
# (from 0.1 s, doubling, jittered), and between tries of a refused connection while the
# coordinator restarts (from 0.1 s up to 1 s, until ``refused_wait_s``: those are not attempts).
_REFUSED = Backoff(retries=0, base_s=0.1, cap_s=1.0)


class CoordinatorError(Exception):
    """A non-2xx answer: ``status_code``, the server's ``code`` and ``message``, ``detail``."""

    def __init__(self, status_code: int, code: str, message: str, detail: Any = None) -> None:
        super().__init__(f"{status_code} {code}: {message}")
        self.status_code = status_code
        self.code = code
        self.message = message
        self.detail = detail


@dataclass(slots=True)
class _Call(Generic[T]):
    """One request and how to read its answer (shared by the sync and async clients)."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    ok: tuple[int, ...] = (200,)
    json: Any = None
    params: dict[str, Any] | None = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    retry: bool = True


def _model(cls: type[BaseModel]) -> Callable[[httpx.Response], Any]:
    return lambda r: cls.model_validate(r.json())


def _list(cls: type[T]) -> Callable[[httpx.Response], list[T]]:
    adapter = TypeAdapter(list[cls])  # type: ignore[valid-type]
    return lambda r: adapter.validate_python(r.json())


def _raise_for(response: httpx.Response, ok: tuple[int, ...]) -> None:
    if response.status_code in ok:
        return
    code, message, detail = "http_error", response.text[:500], None
    try:
        err = response.json()["error"]
        code, message, detail = err["code"], err["message"], err.get("detail")
    except (ValueError, KeyError, TypeError):
        pass
    raise CoordinatorError(response.status_code, code, message, detail)


def _sse_records(lines: Iterator[str]) -> Iterator[VersionRecord]:
    event, data = "message", list[str]()
    for line in lines:
        if line == "":
            if data and event == "version":
                yield VersionRecord.model_validate_json("\n".join(data))
            event, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)


class _Calls:
    """Builders of every call; the clients only execute them."""

    @staticmethod
    def health() -> _Call[Health]:
        return _Call("GET", "/health", _model(Health))

    @staticmethod
    def status(workers: int | None) -> _Call[StatusSummary]:
        params = None if workers is None else {"workers": workers}
        return _Call("GET", "/v1/status", _model(StatusSummary), params=params)

    @staticmethod
    def publish_version(
        manifest: VersionManifest, limits: ModelLimits | None
    ) -> _Call[VersionRecord]:
        body = VersionPublish(manifest=manifest, limits=limits).model_dump(mode="json")
        if limits is None:
            del body["limits"]  # as before limits existed: older coordinators forbid the key
        return _Call("POST", "/v1/versions", _model(VersionRecord), ok=(200, 201), json=body)

    @staticmethod
    def versions(after: int | None, limit: int) -> _Call[list[VersionRecord]]:
        params: dict[str, Any] = {"limit": limit}
        if after is not None:
            params["after"] = after
        return _Call("GET", "/v1/versions", _list(VersionRecord), params=params)

    @staticmethod
    def latest_version() -> _Call[VersionRecord | None]:
        def parse(r: httpx.Response) -> VersionRecord | None:
            return None if r.status_code == 404 else VersionRecord.model_validate(r.json())

        return _Call("GET", "/v1/versions/latest", parse, ok=(200, 404))

    @staticmethod
    def get_version(version: int) -> _Call[VersionRecord]:
        return _Call("GET", f"/v1/versions/{int(version)}", _model(VersionRecord))

    @staticmethod
    def register(reg: WorkerRegistration) -> _Call[HeartbeatAck]:
        return _Call("POST", "/v1/workers", _model(HeartbeatAck), json=reg.model_dump(mode="json"))

    @staticmethod
    def heartbeat(worker_id: str, hb: WorkerHeartbeat) -> _Call[HeartbeatAck]:
        path = f"/v1/workers/{worker_id}/heartbeat"
        return _Call("POST", path, _model(HeartbeatAck), json=hb.model_dump(mode="json"))

    @staticmethod
    def prove(worker_id: str, answer: ProofAnswer) -> _Call[ProofResult]:
        path = f"/v1/workers/{worker_id}/proof"
        return _Call("POST", path, _model(ProofResult), json=answer.model_dump(mode="json"))

    @staticmethod
    def add_challenges(version: int, pool: ChallengePool) -> _Call[ChallengePoolResult]:
        path = f"/v1/versions/{int(version)}/challenges"
        return _Call("POST", path, _model(ChallengePoolResult), json=pool.model_dump(mode="json"))

    @staticmethod
    def challenge_pool(version: int) -> _Call[ChallengePoolStatus]:
        path = f"/v1/versions/{int(version)}/challenges"
        return _Call("GET", path, _model(ChallengePoolStatus))

    @staticmethod
    def workers() -> _Call[list[WorkerInfo]]:
        return _Call("GET", "/v1/workers", _list(WorkerInfo))

    @staticmethod
    def worker(worker_id: str) -> _Call[WorkerInfo]:
        return _Call("GET", f"/v1/workers/{worker_id}", _model(WorkerInfo))

    @staticmethod
    def remove_worker(worker_id: str) -> _Call[None]:
        return _Call("DELETE", f"/v1/workers/{worker_id}", lambda r: None, ok=(204,))

    @staticmethod
    def submit(group: TrajectoryGroup | bytes) -> _Call[SubmitResult]:
        payload = group if isinstance(group, bytes) else encode_group(group)
        return _Call(
            "POST",
            "/v1/trajectories",
            _model(SubmitResult),
            content=payload,
            headers={"Content-Type": MSGPACK},
        )

    @staticmethod
    def lease(max_groups: int, lease_s: float | None, wait_s: float) -> _Call[LeasedBatch]:
        body = {"max_groups": max_groups, "lease_s": lease_s, "wait_s": wait_s}
        return _Call(
            "POST",
            "/v1/batches/lease",
            lambda r: decode_leased_batch(r.content),
            json=body,
            retry=False,
        )

    @staticmethod
    def ack(batch_id: str, nack: bool, rejected: Sequence[GroupRejection] = ()) -> _Call[AckResult]:
        verb = "nack" if nack else "ack"
        if not rejected:
            return _Call("POST", f"/v1/batches/{batch_id}/{verb}", _model(AckResult))
        body = AckRequest(rejected=list(rejected)).model_dump(mode="json")
        return _Call("POST", f"/v1/batches/{batch_id}/{verb}", _model(AckResult), json=body)

    @staticmethod
    def dead_letters(limit: int) -> _Call[DeadLetterList]:
        return _Call("GET", "/v1/dead-letters", _model(DeadLetterList), params={"limit": limit})

    @staticmethod
    def requeue_dead_letter(submission_id: int) -> _Call[None]:
        return _Call("POST", f"/v1/dead-letters/{submission_id}/requeue", lambda r: None, ok=(204,))

    @staticmethod
    def clear_rejections(worker_id: str) -> _Call[None]:
        return _Call("DELETE", f"/v1/workers/{worker_id}/rejections", lambda r: None, ok=(204,))

    @staticmethod
    def extend(batch_id: str, lease_s: float | None) -> _Call[LeaseExtension]:
        return _Call(
            "POST",
            f"/v1/batches/{batch_id}/extend",
            _model(LeaseExtension),
            json={"lease_s": lease_s},
        )

    @staticmethod
    def admission(req: AdmissionRequest) -> _Call[AdmissionResponse]:
        return _Call(
            "POST", "/v1/admission", _model(AdmissionResponse), json=req.model_dump(mode="json")
        )

    @staticmethod
    def metrics_text() -> _Call[str]:
        return _Call("GET", "/metrics", lambda r: r.text)


class CoordinatorClient:
    """Synchronous client. Thread-safe (one ``httpx.Client`` with a connection pool)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 10.0,
        retries: int = 2,
        refused_wait_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        verify: ssl.SSLContext | bool | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.refused_wait_s = refused_wait_s if retries > 0 else 0.0
        self._backoff = Backoff(retries, base_s=0.1, cap_s=2.0)
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=client_headers(self.base_url, token),
            timeout=timeout,
            transport=transport,
            verify=client_verify() if verify is None else verify,
        )

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _run(self, call: _Call[T]) -> T:
        attempts = 1 + (self.retries if call.retry else 0)
        refused_until = time.monotonic() + self.refused_wait_s
        attempt = refusals = 0
        while True:
            try:
                r = self._http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    params=call.params,
                    content=call.content,
                    headers=call.headers,
                )
            except httpx.TransportError as exc:
                if _refused(exc) and time.monotonic() < refused_until:
                    time.sleep(_REFUSED.delay(refusals))  # a restart: not a failed attempt
                    refusals += 1
                    continue
                if attempt + 1 >= attempts:
                    raise
                time.sleep(self._backoff.delay(attempt))
                attempt += 1
                continue
            if r.status_code in _RETRY_STATUS and attempt + 1 < attempts:
                time.sleep(self._backoff.delay(attempt))
                attempt += 1
                continue
            _raise_for(r, call.ok)
            return call.parse(r)

    # reads
    def health(self) -> Health:
        return self._run(_Calls.health())

    def status(self, workers: int | None = None) -> StatusSummary:
        return self._run(_Calls.status(workers))

    def versions(self, after: int | None = None, limit: int = 100) -> list[VersionRecord]:
        return self._run(_Calls.versions(after, limit))

    def latest_version(self) -> VersionRecord | None:
        return self._run(_Calls.latest_version())

    def get_version(self, version: int) -> VersionRecord:
        return self._run(_Calls.get_version(version))

    def workers(self) -> list[WorkerInfo]:
        return self._run(_Calls.workers())

    def worker(self, worker_id: str) -> WorkerInfo:
        return self._run(_Calls.worker(worker_id))

    def metrics_text(self) -> str:
        return self._run(_Calls.metrics_text())

    def iter_version_events(self, after: int | None = None) -> Iterator[VersionRecord]:
        """Yield every version newer than ``after`` (None: starting with the latest one), then
        each new one as it is recorded; reconnects after a dropped connection without gaps."""
        last = after
        while True:
            headers = {"Accept": "text/event-stream"}
            if last is not None:
                headers["Last-Event-ID"] = str(last)
            try:
                with self._http.stream(
                    "GET",
                    "/v1/versions/events",
                    headers=headers,
                    timeout=httpx.Timeout(None, connect=10),
                ) as r:
                    _raise_for(r, (200,))
                    for record in _sse_records(r.iter_lines()):
                        last = record.version
                        yield record
            except httpx.TransportError:
                time.sleep(0.5)

    # trainer
    def publish_version(
        self, manifest: VersionManifest, limits: ModelLimits | None = None
    ) -> VersionRecord:
        """Record a published version, with the model's limits (checked at submissions)."""
        return self._run(_Calls.publish_version(manifest, limits))

    def add_challenges(self, version: int, pool: ChallengePool) -> ChallengePoolResult:
        return self._run(_Calls.add_challenges(version, pool))

    def challenge_pool(self, version: int) -> ChallengePoolStatus:
        """Where ``version``'s weight challenges stand (``wanted``: pairs to post now)."""
        return self._run(_Calls.challenge_pool(version))

    def lease(
        self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0
    ) -> LeasedBatch:
        return self._run(_Calls.lease(max_groups, lease_s, wait_s))

    def ack(self, batch_id: str, rejected: Sequence[GroupRejection] = ()) -> AckResult:
        """Acknowledge a lease; ``rejected``: its groups the trainer refused (dead letters)."""
        return self._run(_Calls.ack(batch_id, nack=False, rejected=rejected))

    def dead_letters(self, limit: int = 100) -> DeadLetterList:
        return self._run(_Calls.dead_letters(limit))

    def requeue_dead_letter(self, submission_id: int) -> None:
        self._run(_Calls.requeue_dead_letter(submission_id))

    def clear_rejections(self, worker_id: str) -> None:
        self._run(_Calls.clear_rejections(worker_id))

    def nack(self, batch_id: str) -> AckResult:
        return self._run(_Calls.ack(batch_id, nack=True))

    def extend(self, batch_id: str, lease_s: float | None = None) -> LeaseExtension:
        """Keep a lease alive: it now expires ``lease_s`` (default: the server's) from now."""
        return self._run(_Calls.extend(batch_id, lease_s))

    # worker
    def register(self, reg: WorkerRegistration) -> HeartbeatAck:
        return self._run(_Calls.register(reg))

    def heartbeat(self, worker_id: str, hb: WorkerHeartbeat) -> HeartbeatAck:
        return self._run(_Calls.heartbeat(worker_id, hb))

    def remove_worker(self, worker_id: str) -> None:
        self._run(_Calls.remove_worker(worker_id))

    def prove(self, worker_id: str, nonce: str, answer: str) -> ProofResult:
        return self._run(_Calls.prove(worker_id, ProofAnswer(nonce=nonce, answer=answer)))

    def submit(self, group: TrajectoryGroup | bytes) -> SubmitResult:
        return self._run(_Calls.submit(group))

    def admission(
        self, worker_id: str, want: int, applied_version: int | None = None
    ) -> AdmissionResponse:
        req = AdmissionRequest(worker_id=worker_id, want=want, applied_version=applied_version)
        return self._run(_Calls.admission(req))


class AsyncCoordinatorClient:
    """asyncio client with the same methods as :class:`CoordinatorClient` (awaitable)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 10.0,
        retries: int = 2,
        refused_wait_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: ssl.SSLContext | bool | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.refused_wait_s = refused_wait_s if retries > 0 else 0.0
        self._backoff = Backoff(retries, base_s=0.1, cap_s=2.0)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=client_headers(self.base_url, token),
            timeout=timeout,
            transport=transport,
            verify=client_verify() if verify is None else verify,
        )

    async def __aenter__(self) -> AsyncCoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _run(self, call: _Call[T]) -> T:
        attempts = 1 + (self.retries if call.retry else 0)
        refused_until = time.monotonic() + self.refused_wait_s
        attempt = refusals = 0
        while True:
            try:
                r = await self._http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    params=call.params,
                    content=call.content,
                    headers=call.headers,
                )
            except httpx.TransportError as exc:
                if _refused(exc) and time.monotonic() < refused_until:
                    await asyncio.sleep(_REFUSED.delay(refusals))  # a restart: not an attempt
                    refusals += 1
                    continue
                if attempt + 1 >= attempts:
                    raise
                await asyncio.sleep(self._backoff.delay(attempt))
                attempt += 1
                continue
            if r.status_code in _RETRY_STATUS and attempt + 1 < attempts:
                await asyncio.sleep(self._backoff.delay(attempt))
                attempt += 1
                continue
            _raise_for(r, call.ok)
            return call.parse(r)

    async def health(self) -> Health:
        return await self._run(_Calls.health())

    async def status(self, workers: int | None = None) -> StatusSummary:
        return await self._run(_Calls.status(workers))

    async def versions(self, after: int | None = None, limit: int = 100) -> list[VersionRecord]:
        return await self._run(_Calls.versions(after, limit))

    async def latest_version(self) -> VersionRecord | None:
        return await self._run(_Calls.latest_version())

    async def get_version(self, version: int) -> VersionRecord:
        return await self._run(_Calls.get_version(version))

    async def workers(self) -> list[WorkerInfo]:
        return await self._run(_Calls.workers())

    async def worker(self, worker_id: str) -> WorkerInfo:
        return await self._run(_Calls.worker(worker_id))

    async def metrics_text(self) -> str:
        return await self._run(_Calls.metrics_text())

    async def iter_version_events(self, after: int | None = None) -> AsyncIterator[VersionRecord]:
        """As :meth:`CoordinatorClient.iter_version_events`."""
        last = after
        while True:
            headers = {"Accept": "text/event-stream"}
            if last is not None:
                headers["Last-Event-ID"] = str(last)
            try:
                async with self._http.stream(
                    "GET",
                    "/v1/versions/events",
                    headers=headers,
                    timeout=httpx.Timeout(None, connect=10),
                ) as r:
                    _raise_for(r, (200,))
                    lines: list[str] = []
                    async for line in r.aiter_lines():
                        lines.append(line)
                        if line == "":
                            for record in _sse_records(iter(lines)):
                                last = record.version
                                yield record
                            lines = []
            except httpx.TransportError:
                await asyncio.sleep(0.5)

    async def publish_version(
        self, manifest: VersionManifest, limits: ModelLimits | None = None
    ) -> VersionRecord:
        return await self._run(_Calls.publish_version(manifest, limits))

    async def add_challenges(self, version: int, pool: ChallengePool) -> ChallengePoolResult:
        return await self._run(_Calls.add_challenges(version, pool))

    async def challenge_pool(self, version: int) -> ChallengePoolStatus:
        return await self._run(_Calls.challenge_pool(version))

    async def lease(
        self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0
    ) -> LeasedBatch:
        return await self._run(_Calls.lease(max_groups, lease_s, wait_s))

    async def ack(self, batch_id: str, rejected: Sequence[GroupRejection] = ()) -> AckResult:
        return await self._run(_Calls.ack(batch_id, nack=False, rejected=rejected))

    async def nack(self, batch_id: str) -> AckResult:
        return await self._run(_Calls.ack(batch_id, nack=True))

    async def extend(self, batch_id: str, lease_s: float | None = None) -> LeaseExtension:
        return await self._run(_Calls.extend(batch_id, lease_s))

    async def register(self, reg: WorkerRegistration) -> HeartbeatAck:
        return await self._run(_Calls.register(reg))

    async def heartbeat(self, worker_id: str, hb: WorkerHeartbeat) -> HeartbeatAck:
        return await self._run(_Calls.heartbeat(worker_id, hb))

    async def remove_worker(self, worker_id: str) -> None:
        await self._run(_Calls.remove_worker(worker_id))

    async def prove(self, worker_id: str, nonce: str, answer: str) -> ProofResult:
        return await self._run(_Calls.prove(worker_id, ProofAnswer(nonce=nonce, answer=answer)))

    async def submit(self, group: TrajectoryGroup | bytes) -> SubmitResult:
        return await self._run(_Calls.submit(group))

    async def admission(
        self, worker_id: str, want: int, applied_version: int | None = None
    ) -> AdmissionResponse:
        req = AdmissionRequest(worker_id=worker_id, want=want, applied_version=applied_version)
        return await self._run(_Calls.admission(req))


__all__ = ["AsyncCoordinatorClient", "CoordinatorClient", "CoordinatorError"]
