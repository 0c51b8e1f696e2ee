"""Bearer tokens per role, compared in constant time.

Roles: ``trainer`` (publish versions, lease/ack batches), ``worker`` (register, heartbeat, submit,
admission), ``reader`` (status, versions, plans, metrics, page: public unless
``public_reads=false``, then any configured token). The token travels in ``X-Deltarl-Token``
(which the Hugging Face Spaces proxy leaves alone) or ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
from typing import Literal

from fastapi import Request

from deltarl.services.coordinator.errors import ApiError
from deltarl.services.coordinator.schemas.common import TOKEN_HEADER
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


def _matches(token: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(token.encode(), expected.encode())


def check_role(settings: CoordinatorSettings, role: Role, request: Request) -> None:
    """Raise 401/403 unless the request carries a token granting ``role``."""
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
    token = presented_token(request)
    if token is None:
        raise ApiError(
            401,
            "unauthorized",
            f"this endpoint needs the {role} token in the {TOKEN_HEADER} header "
            "(or Authorization: Bearer)",
        )
    # compare against every candidate (no early exit) so timing does not tell which matched
    ok = False
    for expected in configured:
        ok |= _matches(token, expected)
    if not ok:
        raise ApiError(403, "forbidden", f"the token does not grant the {role} role")
