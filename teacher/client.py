"""Clients of the teacher service: :class:`TeacherClient` (async, for rollout workers) and
:class:`SyncTeacherClient` (scripts, tests).

Both speak the binary format (docs/formats.md, "Teacher logprobs"), verify TLS like every
deltarl client (``DELTARL_CA_BUNDLE``), and retry what may succeed later: connection errors,
timeouts, 5xx answers and 429, with the clients' one back-off policy
(:class:`~deltarl.services.common.retry.Backoff`: attempt ``a`` sleeps ``uniform(0,
min(max_backoff_s, backoff_s * 2**a))``), until ``retries`` retries or the ``deadline_s`` budget
is spent; then :class:`TeacherUnavailable` says how many attempts were
made and what the last failure was. A 4xx other than 429 is the caller's fault and is raised at
once as :class:`TeacherRequestError` with the server's code and detail.

Only httpx, numpy and the wire module are imported (no torch, no server code).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import httpx
import numpy as np

from deltarl.services.common.client_headers import client_headers
from deltarl.services.common.retry import Backoff
from deltarl.services.common.tls import client_verify
from deltarl.teacher.wire import (
    BINARY_MEDIA_TYPE,
    DEFAULT_TOP_K,
    LogprobRequest,
    LogprobResponse,
    WireError,
    decode_response,
    encode_request,
)

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class TeacherError(RuntimeError):
    """Base class of the client's errors."""


class TeacherRequestError(TeacherError):
    """The server refused the request (4xx other than 429): retrying would not help."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(f"teacher answered {status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail


class TeacherUnavailable(TeacherError):
    """No answer within the retry budget (connection errors, timeouts, 5xx, 429)."""


def _refusal(response: httpx.Response) -> TeacherRequestError:
    try:
        body = response.json()
        code, detail = str(body.get("code", "")), str(body.get("detail", ""))
    except (ValueError, AttributeError):
        code, detail = "", response.text[:300]
    return TeacherRequestError(response.status_code, code or "ERROR", detail)


def _wait(policy: Backoff, attempt: int, started: float, last: str) -> float:
    """Seconds to sleep before retry ``attempt + 1``; raises when the budget is spent."""
    if policy.gives_up(attempt, started):
        raise TeacherUnavailable(
            f"the teacher did not answer after {attempt + 1} attempt(s) in "
            f"{time.monotonic() - started:.1f} s (last: {last})"
        )
    return policy.wait_before(attempt, started)


def _outcome(response: httpx.Response, max_answer_bytes: int | None) -> LogprobResponse | str:
    """The decoded answer, or (for a retryable status) a description of the failure."""
    if response.status_code in RETRY_STATUS:
        return f"HTTP {response.status_code}: {response.text[:200]}"
    if response.status_code != 200:
        raise _refusal(response)
    try:
        return decode_response(response.content, max_answer_bytes)
    except WireError as exc:
        raise TeacherError(f"the teacher's answer is malformed: {exc}") from None


def make_request(
    sequences: Sequence[Sequence[int]] | Sequence[np.ndarray],
    prompt_lens: Sequence[int],
    temperature: float | Sequence[float] = 1.0,
    top_k: int | Sequence[int] | None = None,
) -> LogprobRequest:
    """A request from Python values; ``top_k=None``: the server's default."""
    temps = float(temperature) if isinstance(temperature, int | float) else list(temperature)
    if top_k is None:
        ks: int | list[int] = DEFAULT_TOP_K
    else:
        ks = top_k if isinstance(top_k, int) else list(top_k)
    return LogprobRequest.build([np.asarray(s) for s in sequences], list(prompt_lens), temps, ks)


def first_trained(mask: Sequence[int] | np.ndarray) -> int:
    """The ``prompt_len`` to send for a trajectory: its first trained position (mask 1).
    Multi-turn trajectories have environment tokens (mask 0) after it: they are scored too and
    dropped by :func:`trained_view`."""
    hits = np.flatnonzero(np.asarray(mask) == 1)
    if not len(hits) or hits[0] < 1:
        raise ValueError("a trajectory needs a trained position (mask 1) after its first token")
    return int(hits[0])


@dataclass(frozen=True)
class TeacherView:
    """The teacher's scores at a trajectory's trained positions, shaped like the ``teacher`` map
    of the trajectory wire format ``deltarl-traj-v2`` (services/coordinator/schemas/
    trajectories.py): ``m`` positions, ``k`` entries each, flattened row-major."""

    k: int
    temperature: float
    sampled: np.ndarray  # float32 [m]
    ids: np.ndarray  # int32 [m * k]
    logprobs: np.ndarray  # float32 [m * k]
    positions: np.ndarray  # int32 [m]: the trained token positions, ascending


def trained_view(
    response: LogprobResponse,
    index: int,
    mask: Sequence[int] | np.ndarray,
    prompt_len: int,
    temperature: float,
) -> TeacherView:
    """Sequence ``index`` of ``response`` (sent with ``prompt_len``, e.g. :func:`first_trained`)
    reduced to the positions where ``mask`` is 1."""
    sampled, ids, lps = response.sequence(index)
    mask_arr = np.asarray(mask)
    if len(sampled) != len(mask_arr) - prompt_len:
        raise ValueError(
            f"sequence {index} has {len(sampled)} scored positions; the mask implies "
            f"{len(mask_arr) - prompt_len}"
        )
    k = ids.shape[1]
    if k < 1:
        raise ValueError("the trajectory format needs top_k >= 1")
    positions = np.flatnonzero(mask_arr[prompt_len:] == 1)
    return TeacherView(
        k=k,
        temperature=float(temperature),
        sampled=np.ascontiguousarray(sampled[positions]),
        ids=np.ascontiguousarray(ids[positions]).reshape(-1),
        logprobs=np.ascontiguousarray(lps[positions]).reshape(-1),
        positions=(positions + prompt_len).astype(np.int32),
    )


class TeacherClient:
    """Async client: ``async with TeacherClient(url, token) as t: await t.logprobs(...)``."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        timeout_s: float = 60.0,
        retries: int = 6,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        deadline_s: float | None = 120.0,
        ca_bundle: str | None = None,
        max_answer_bytes: int | None = 1 << 30,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._policy = Backoff(retries, backoff_s, max_backoff_s, deadline_s)
        self._max_answer = max_answer_bytes
        kwargs: dict[str, Any] = {} if transport is None else {"transport": transport}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=client_headers(self.base_url, token),
            timeout=timeout_s,
            verify=client_verify(ca_bundle),
            **kwargs,
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def info(self) -> dict[str, Any]:
        response = await self._http.get("/v1/info")
        if response.status_code != 200:
            raise _refusal(response)
        result: dict[str, Any] = response.json()
        return result

    async def score(self, request: LogprobRequest) -> LogprobResponse:
        """Send one request (binary), retrying per the policy."""
        body = encode_request(request)
        headers = {"Content-Type": BINARY_MEDIA_TYPE, "Accept": BINARY_MEDIA_TYPE}
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                response = await self._http.post("/v1/logprobs", content=body, headers=headers)
                outcome = _outcome(response, self._max_answer)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            if isinstance(outcome, LogprobResponse):
                return outcome
            await asyncio.sleep(_wait(self._policy, attempt, started, outcome))
            attempt += 1

    async def logprobs(
        self,
        sequences: Sequence[Sequence[int]] | Sequence[np.ndarray],
        prompt_lens: Sequence[int],
        temperature: float | Sequence[float] = 1.0,
        top_k: int | Sequence[int] | None = None,
    ) -> LogprobResponse:
        """Scores of ``sequences`` (see :class:`~deltarl.teacher.wire.LogprobResponse`)."""
        return await self.score(make_request(sequences, prompt_lens, temperature, top_k))


class SyncTeacherClient:
    """Blocking twin of :class:`TeacherClient` (same arguments and errors)."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        timeout_s: float = 60.0,
        retries: int = 6,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        deadline_s: float | None = 120.0,
        ca_bundle: str | None = None,
        max_answer_bytes: int | None = 1 << 30,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._policy = Backoff(retries, backoff_s, max_backoff_s, deadline_s)
        self._max_answer = max_answer_bytes
        kwargs: dict[str, Any] = {} if transport is None else {"transport": transport}
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=client_headers(self.base_url, token),
            timeout=timeout_s,
            verify=client_verify(ca_bundle),
            **kwargs,
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def info(self) -> dict[str, Any]:
        response = self._http.get("/v1/info")
        if response.status_code != 200:
            raise _refusal(response)
        result: dict[str, Any] = response.json()
        return result

    def score(self, request: LogprobRequest) -> LogprobResponse:
        body = encode_request(request)
        headers = {"Content-Type": BINARY_MEDIA_TYPE, "Accept": BINARY_MEDIA_TYPE}
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                response = self._http.post("/v1/logprobs", content=body, headers=headers)
                outcome = _outcome(response, self._max_answer)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            if isinstance(outcome, LogprobResponse):
                return outcome
            time.sleep(_wait(self._policy, attempt, started, outcome))
            attempt += 1

    def logprobs(
        self,
        sequences: Sequence[Sequence[int]] | Sequence[np.ndarray],
        prompt_lens: Sequence[int],
        temperature: float | Sequence[float] = 1.0,
        top_k: int | Sequence[int] | None = None,
    ) -> LogprobResponse:
        return self.score(make_request(sequences, prompt_lens, temperature, top_k))
