"""Typed clients of the environment server (any task) over stateful HTTP sessions (httpx).

:class:`EnvClient` (async) and :class:`SyncEnvClient` (sync) have the same methods. They import
only httpx and the wire models (never the server), check every status code, validate every
answer with ``model_validate_json`` and raise :class:`~.models.EnvError` with the server's
:class:`~.models.ErrorCode` on failure.

Retries: connection errors, time-outs and ``CAPACITY_REACHED`` are retried ``retries`` times with
the clients' one back-off policy (:class:`~deltarl.services.common.retry.Backoff`: exponential from
``backoff_s``, full jitter, at most 5 s a wait). ``step`` always sends a ``request_id`` (a fresh
uuid4 unless given), so a retried step is applied once. A retried ``reset`` may leave an orphan
session behind; the server frees it after its idle time-out.

Example (rollout worker)::

    async with EnvClient("http://127.0.0.1:8001", token=None) as env:
        async with env.episode(seed=3) as ep:
            result = ep.first
            while not result.done:
                result = await ep.step(model_text(result.observation))
            reward = result.reward
"""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from deltarl.env_server.core.models import (
    SESSION_HEADER,
    CloseResponse,
    EnvError,
    EnvMetadata,
    ErrorCode,
    ErrorResponse,
    HealthResponse,
    StepResult,
    TextArenaObservation,
)
from deltarl.env_server.tasks import AnyStepResult, StateResponse
from deltarl.services.common.client_headers import client_headers
from deltarl.services.common.retry import Backoff
from deltarl.services.common.tls import client_verify

T = TypeVar("T", bound=BaseModel)
Result = StepResult[TextArenaObservation]  # the served task's observation (AnyStepResult)
_RETRY_CODES = frozenset({ErrorCode.CAPACITY_REACHED})


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    method: str
    path: str
    model: type[T]
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


def _decode(response: httpx.Response, model: type[T]) -> T:
    """The validated body of a 2xx answer, else :class:`EnvError` with the server's code."""
    if response.is_success:
        try:
            return model.model_validate_json(response.content)
        except ValidationError as exc:
            raise EnvError(
                ErrorCode.VALIDATION_ERROR,
                f"{response.request.url.path}: the server's answer does not match "
                f"{model.__name__} (client/server version mismatch?): {exc}",
            ) from exc
    try:
        err = ErrorResponse.model_validate_json(response.content)
    except ValidationError:
        code = ErrorCode.UNAUTHORIZED if response.status_code == 401 else ErrorCode.INTERNAL_ERROR
        raise EnvError(code, f"HTTP {response.status_code}: {response.text[:200]}") from None
    raise EnvError(err.code, err.detail)


class _Calls:
    """Request construction shared by both clients."""

    def __init__(self, base_url: str, token: str | None, retries: int, backoff_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = client_headers(self.base_url, token)
        self.retries = retries
        self.backoff = Backoff(retries, backoff_s, cap_s=5.0)

    @staticmethod
    def _health() -> _Call[HealthResponse]:
        return _Call("GET", "/health", HealthResponse)

    @staticmethod
    def _metadata() -> _Call[EnvMetadata]:
        return _Call("GET", "/metadata", EnvMetadata)

    @staticmethod
    def _reset(
        seed: int | None,
        episode_id: str | None,
        session_id: str | None,
        options: Mapping[str, Any] | None = None,
        policy_version: int | None = None,
    ) -> _Call[Result]:
        body = {
            "seed": seed,
            "episode_id": episode_id,
            "session_id": session_id,
            "options": dict(options) if options else None,
            "policy_version": policy_version,
        }
        return _Call(
            "POST", "/reset", AnyStepResult, json={k: v for k, v in body.items() if v is not None}
        )

    @staticmethod
    def _step(session_id: str, message: str, request_id: str | None) -> _Call[Result]:
        body = {
            "session_id": session_id,
            "action": {"message": message},
            "request_id": request_id or uuid.uuid4().hex,
        }
        return _Call("POST", "/step", AnyStepResult, json=body)

    @staticmethod
    def _state(session_id: str) -> _Call[StateResponse]:
        return _Call("GET", "/state", StateResponse, headers={SESSION_HEADER: session_id})

    @staticmethod
    def _close(session_id: str) -> _Call[CloseResponse]:
        return _Call("POST", "/close", CloseResponse, json={"session_id": session_id})

    def _retryable(self, attempt: int, exc: Exception) -> bool:
        if attempt >= self.retries:
            return False
        if isinstance(exc, EnvError):
            return exc.code in _RETRY_CODES
        return isinstance(exc, httpx.TransportError)

    def _delay(self, attempt: int) -> float:
        return self.backoff.delay(attempt)


class EnvClient(_Calls):
    """Async client; one instance (one connection pool) serves any number of sessions."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: ssl.SSLContext | bool | None = None,
    ) -> None:
        super().__init__(base_url, token, retries, backoff_s)
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=self.headers,
            timeout=timeout_s,
            limits=limits,
            transport=transport,
            verify=client_verify() if verify is None else verify,
        )

    async def _send(self, call: _Call[T]) -> T:
        attempt = 0
        while True:
            try:
                response = await self._http.request(
                    call.method, call.path, json=call.json, params=call.params, headers=call.headers
                )
                return _decode(response, call.model)
            except (httpx.TransportError, EnvError) as exc:
                if not self._retryable(attempt, exc):
                    raise
                await asyncio.sleep(self._delay(attempt))
                attempt += 1

    async def health(self) -> HealthResponse:
        return await self._send(self._health())

    async def metadata(self) -> EnvMetadata:
        return await self._send(self._metadata())

    async def reset(
        self,
        *,
        seed: int | None = None,
        episode_id: str | None = None,
        session_id: str | None = None,
        options: Mapping[str, Any] | None = None,
        policy_version: int | None = None,
    ) -> Result:
        """Open a session (or reset ``session_id``); the result carries ``session_id``.
        ``options``: the episode's reset options (the served task's; Wordle's: max_guesses, reward
        shaping), validated by the server; ``policy_version``: the version the episode's group
        started under (Wordle's guess curriculum reads it)."""
        return await self._send(self._reset(seed, episode_id, session_id, options, policy_version))

    async def step(self, session_id: str, message: str, *, request_id: str | None = None) -> Result:
        """Play ``message`` (text holding ``[guess]``) in the session."""
        return await self._send(self._step(session_id, message, request_id))

    async def state(self, session_id: str) -> BaseModel:
        return (await self._send(self._state(session_id))).root

    async def close_session(self, session_id: str) -> bool:
        """Free the session on the server; False if it was already gone."""
        return (await self._send(self._close(session_id))).closed

    @asynccontextmanager
    async def episode(
        self,
        *,
        seed: int | None = None,
        episode_id: str | None = None,
        options: Mapping[str, Any] | None = None,
        policy_version: int | None = None,
    ) -> AsyncIterator[AsyncEpisode]:
        """A session that is closed on exit, whatever happens inside."""
        first = await self.reset(
            seed=seed, episode_id=episode_id, options=options, policy_version=policy_version
        )
        assert first.session_id is not None
        try:
            yield AsyncEpisode(self, first.session_id, first)
        finally:
            await self.close_session(first.session_id)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@dataclass(slots=True)
class AsyncEpisode:
    """One open session of an :class:`EnvClient`; ``first`` is the reset observation."""

    client: EnvClient
    session_id: str
    first: Result

    async def step(self, message: str) -> Result:
        return await self.client.step(self.session_id, message)

    async def state(self) -> BaseModel:
        return await self.client.state(self.session_id)


class SyncEnvClient(_Calls):
    """Blocking twin of :class:`EnvClient` (same methods, same errors)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        transport: httpx.BaseTransport | None = None,
        verify: ssl.SSLContext | bool | None = None,
    ) -> None:
        super().__init__(base_url, token, retries, backoff_s)
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=self.headers,
            timeout=timeout_s,
            transport=transport,
            verify=client_verify() if verify is None else verify,
        )

    def _send(self, call: _Call[T]) -> T:
        attempt = 0
        while True:
            try:
                response = self._http.request(
                    call.method, call.path, json=call.json, params=call.params, headers=call.headers
                )
                return _decode(response, call.model)
            except (httpx.TransportError, EnvError) as exc:
                if not self._retryable(attempt, exc):
                    raise
                time.sleep(self._delay(attempt))
                attempt += 1

    def health(self) -> HealthResponse:
        return self._send(self._health())

    def metadata(self) -> EnvMetadata:
        return self._send(self._metadata())

    def reset(
        self,
        *,
        seed: int | None = None,
        episode_id: str | None = None,
        session_id: str | None = None,
        options: Mapping[str, Any] | None = None,
        policy_version: int | None = None,
    ) -> Result:
        return self._send(self._reset(seed, episode_id, session_id, options, policy_version))

    def step(self, session_id: str, message: str, *, request_id: str | None = None) -> Result:
        return self._send(self._step(session_id, message, request_id))

    def state(self, session_id: str) -> BaseModel:
        return self._send(self._state(session_id)).root

    def close_session(self, session_id: str) -> bool:
        return self._send(self._close(session_id)).closed

    @contextmanager
    def episode(
        self,
        *,
        seed: int | None = None,
        episode_id: str | None = None,
        options: Mapping[str, Any] | None = None,
        policy_version: int | None = None,
    ) -> Iterator[SyncEpisode]:
        first = self.reset(
            seed=seed, episode_id=episode_id, options=options, policy_version=policy_version
        )
        assert first.session_id is not None
        try:
            yield SyncEpisode(self, first.session_id, first)
        finally:
            self.close_session(first.session_id)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SyncEnvClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(slots=True)
class SyncEpisode:
    """One open session of a :class:`SyncEnvClient`."""

    client: SyncEnvClient
    session_id: str
    first: Result

    def step(self, message: str) -> Result:
        return self.client.step(self.session_id, message)

    def state(self) -> BaseModel:
        return self.client.state(self.session_id)
