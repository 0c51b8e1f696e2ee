"""Bearer tokens per role, compared in constant time.

Roles: ``trainer`` (publish versions, lease/ack batches), ``worker`` (register, heartbeat, submit,
admission), ``reader`` (status, versions, workers, metrics, page: public unless
``public_reads=false``, then any configured token). The token travels in ``X-Deltarl-Token``
(which the Hugging Face Spaces proxy leaves alone) or ``Authorization: Bearer <token>``.

Per-worker credentials: with ``worker_key`` set, each worker has its own token,
``dw1/<worker id>/<HMAC-SHA256(worker_key, "deltarl-worker-token-v1\0" + worker id) hex>``
(:func:`worker_token_for`). The coordinator recomputes the MAC (nothing to store, any number of
workers), and a worker route accepts the token only for the worker id it acts on (the path's
``worker_id``, the body's, or the submitted group's), so a worker holding its own token cannot
register, heartbeat, prove, submit or leave as another. Revoking one worker means rotating the
key (every worker gets a new token).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Literal

from fastapi import Request

from deltarl.services.common.client_headers import TOKEN_HEADER
from deltarl.services.coordinator.errors import ApiError
from deltarl.services.coordinator.settings import CoordinatorSettings

Role = Literal["trainer", "worker", "reader"]


def presented_token(request: Request) -> str | None:
    token = request.headers.get(TOKEN_HEADER)
    if token:
        return token
    auth = request.headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


WORKER_TOKEN_PREFIX = "dw1/"
MSGPACK_MEDIA_TYPE = "application/msgpack"  # trajectory groups (routers.common.MSGPACK)


def media_type(content_type: str) -> str:
    """``Content-Type`` without its parameters, lower case (``application/json``)."""
    return content_type.split(";", 1)[0].strip().lower()


def worker_token_for(worker_key: str, worker_id: str) -> str:
    """The token of ``worker_id`` under ``worker_key`` (see the module docstring)."""
    mac = hmac.new(
        worker_key.encode(), b"deltarl-worker-token-v1\0" + worker_id.encode(), hashlib.sha256
    )
    return f"{WORKER_TOKEN_PREFIX}{worker_id}/{mac.hexdigest()}"


def token_worker(worker_key: str, token: str) -> str | None:
    """The worker id a per-worker token belongs to, or None if it is not a valid one (the MAC
    is compared in constant time)."""
    if not token.startswith(WORKER_TOKEN_PREFIX):
        return None
    worker_id, sep, _ = token[len(WORKER_TOKEN_PREFIX) :].rpartition("/")
    if not sep or not worker_id:
        return None
    expected = worker_token_for(worker_key, worker_id)
    return worker_id if hmac.compare_digest(token.encode(), expected.encode()) else None


def unauthenticated_roles(settings: CoordinatorSettings) -> list[str]:
    """One line per write role that anyone may take (insecure mode left it without a token),
    saying what that allows; empty when every write role is protected. Reads are left out:
    ``public_reads`` makes them public on purpose."""
    lines = []
    if not settings.trainer_token:
        lines.append("no trainer token: anyone can publish versions and lease batches")
    if not (settings.worker_token or settings.worker_key):
        lines.append(
            "no worker token or worker key: anyone can register, heartbeat and submit "
            "trajectories as any worker"
        )
    return lines


def _matches(token: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(token.encode(), expected.encode())


def check_role(settings: CoordinatorSettings, role: Role, request: Request) -> None:
    """Raise 401/403 unless the request carries a token granting ``role``. With per-worker
    credentials, a worker token also records its worker id in ``request.state.worker_id``
    (the caller checks it against the worker the request acts for: :func:`check_worker`)."""
    if role == "worker" and settings.worker_key:
        token = _presented_or_401(request, role)
        worker_id = token_worker(settings.worker_key, token)
        if worker_id is None:
            raise ApiError(
                403,
                "forbidden",
                "the token is not a worker token of this coordinator (with per-worker "
                "credentials each worker uses its own: 'deltarl worker-token ID')",
            )
        request.state.worker_id = worker_id
        return
    if role == "reader" and not settings.public_reads and settings.worker_key:
        presented = presented_token(request)
        if presented is not None and token_worker(settings.worker_key, presented) is not None:
            return
    if role == "trainer":
        allowed = [settings.trainer_token]
    elif role == "worker":
        allowed = [settings.worker_token]
    else:
        if settings.public_reads:
            return
        allowed = [settings.trainer_token, settings.worker_token, settings.read_token]
    configured = [t for t in allowed if t]
    if not configured:  # insecure development mode: this role is open
        return
    token = _presented_or_401(request, role)
    # compare against every candidate (no early exit) so timing does not tell which matched
    ok = False
    for expected in configured:
        ok |= _matches(token, expected)
    if not ok:
        raise ApiError(403, "forbidden", f"the token does not grant the {role} role")


def _presented_or_401(request: Request, role: Role) -> str:
    token = presented_token(request)
    if token is None:
        raise ApiError(
            401,
            "unauthorized",
            f"this endpoint needs the {role} token in the {TOKEN_HEADER} header "
            "(or Authorization: Bearer)",
        )
    return token


def acting_worker_error(holder: str, worker_id: object) -> ApiError:
    """The 403 for a per-worker token of ``holder`` used to act for ``worker_id``."""
    return ApiError(
        403,
        "forbidden",
        f"this token belongs to worker {holder!r}; it cannot act for worker {worker_id!r}",
    )


def check_acting_worker(request: Request, worker_id: object) -> None:
    """403 unless a per-worker token (if one authenticated the request) is ``worker_id``'s."""
    holder = getattr(request.state, "worker_id", None)
    if holder is None:  # shared worker token or insecure mode: nothing to check
        return
    if worker_id != holder:
        raise acting_worker_error(holder, worker_id)


async def check_worker(settings: CoordinatorSettings, request: Request) -> None:
    """The worker role, and with per-worker credentials the worker the request acts for: the
    path's ``worker_id``, else the body's ``worker_id`` (register, admission). A binary
    trajectory group names its worker inside the payload: the route checks it after decoding
    (:func:`check_acting_worker`).

    The body is read as JSON whatever its ``Content-Type`` says: FastAPI parses more than
    ``application/json`` as JSON (any ``application/*+json``, parameters, other spellings), so a
    check keyed on the media type could be walked around; ``json.loads`` of the same bytes gives
    the same object FastAPI validates. Only a msgpack body (which FastAPI never parses as JSON,
    and which the submit route decodes and checks itself) is left to its route."""
    check_role(settings, "worker", request)
    if getattr(request.state, "worker_id", None) is None:
        return
    worker_id = request.path_params.get("worker_id")
    if worker_id is None:
        if media_type(request.headers.get("content-type", "")) == MSGPACK_MEDIA_TYPE:
            return  # trajectory submission: checked once decoded
        body = await request.body()
        if not body:
            return  # no body: the route's validation answers 422
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            return  # not JSON: FastAPI cannot parse it either, the route answers 422
        worker_id = parsed.get("worker_id") if isinstance(parsed, dict) else None
    check_acting_worker(request, worker_id)
