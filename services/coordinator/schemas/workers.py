"""Rollout workers: registration, heartbeats and what the coordinator knows about each.

Order of calls for a worker: ``register`` (again after a restart or after being marked lost:
re-registering the same id is a clean rejoin), then ``heartbeat`` every
``HeartbeatAck.heartbeat_interval_s``. A worker that sends no heartbeat for ``lost_after_s`` is
reported ``lost``; its next heartbeat (or registration) makes it ``active`` again.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from deltarl.services.coordinator.schemas.common import (
    ID_PATTERN,
    MAX_IN_FLIGHT,
    Count,
    Version,
    WireModel,
)

WorkerState = Literal["active", "lost"]


class WorkerRegistration(WireModel):
    """``POST /v1/workers`` body (worker role)."""

    worker_id: str = Field(
        pattern=ID_PATTERN,
        description="Stable id chosen by the worker: 1 to 128 letters, digits or ._:@- "
        "(path-safe), starting with a letter or digit.",
    )
    engine: str = Field(
        min_length=1, max_length=64, description="Inference engine, e.g. 'vllm', 'hf'."
    )
    model: str = Field(min_length=1, max_length=256, description="Model name or path served.")
    capacity: int = Field(
        ge=1, le=1_000_000, description="Episodes (trajectory groups) it can run concurrently."
    )


class WorkerHeartbeat(WireModel):
    """``POST /v1/workers/{worker_id}/heartbeat`` body (worker role)."""

    applied_version: Version | None = Field(
        default=None,
        description="Weight version the engine currently serves; None while it has none loaded.",
    )
    in_flight: int = Field(
        default=0,
        ge=0,
        le=MAX_IN_FLIGHT,
        description=f"Trajectory groups being generated right now (at most {MAX_IN_FLIGHT:,}).",
    )
    last_error: str | None = Field(
        default=None,
        max_length=4096,
        description="Most recent error (e.g. a failed weight apply); None clears it.",
    )
    weights_digest: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{16,128}$",
        description="State digest (lowercase hex, deltarl.weightsync.digest) of the weights "
        "the engine serves at applied_version, as the worker verified them after applying; the "
        "coordinator compares it with the trainer's digest of that version. None: not reported.",
    )


class WorkerInfo(WireModel):
    """A worker as the coordinator sees it (``GET /v1/workers``)."""

    worker_id: str = Field(description="Id chosen by the worker.")
    engine: str = Field(description="Inference engine, as registered.")
    model: str = Field(description="Model served, as registered.")
    capacity: Count = Field(description="Concurrent groups it can run, as registered.")
    state: WorkerState = Field(description="'lost' when no heartbeat for lost_after_s.")
    applied_version: Version | None = Field(description="Last reported version; None if none yet.")
    in_flight: Count = Field(description="Last reported groups in flight.")
    last_error: str | None = Field(description="Last reported error; None if none.")
    registered_at: float = Field(description="First registration (Unix s).")
    last_seen: float = Field(description="Last registration or heartbeat (Unix s).")
    rejoins: Count = Field(description="Times it came back after being lost or re-registered.")
    lag_versions: Count | None = Field(
        description="latest version - applied_version; None if either is unknown."
    )
    lag_seconds: float | None = Field(
        description="Seconds since the first version newer than applied_version was recorded; "
        "0 when up to date; None if unknown."
    )
    submitted: Count = Field(description="Trajectory groups accepted from this worker.")
    weights_digest: str | None = Field(
        default=None, description="Last reported state digest of the served weights; None if none."
    )
    digest_matches: bool | None = Field(
        default=None,
        description="Self-reported: True when weights_digest equals the trainer's state digest of "
        "applied_version, False on a mismatch, None when not reported or the version is unknown. "
        "Not a proof (the digest is public): see weights_verified.",
    )
    weights_verified: bool | None = Field(
        default=None,
        description="Proven: True when the worker answered a fresh weight challenge correctly at "
        "the version it serves now (applied_version), a keyed digest of a nonce-chosen sample of "
        "its weights that only a holder of the trainer's weights can compute (docs/security.md); "
        "False when its last answer at that version was wrong; None while unproven (no challenge "
        "answered yet at this version, or the trainer publishes no challenges).",
    )
    weights_proven_version: Version | None = Field(
        default=None, description="Version of the last correct weight proof; None if none."
    )
    weights_proven_at: float | None = Field(
        default=None, description="When the last correct proof was received (Unix s)."
    )
    rejected_groups: Count = Field(
        default=0,
        description="Groups of this worker the trainer refused (kept across re-registration).",
    )
    last_rejection: str | None = Field(
        default=None, description="The last refusal: reason code and detail; None: none."
    )
    suspect: bool = Field(
        default=False,
        description="True once rejected_groups reaches the coordinator's suspect_after: its "
        "samples do not hold up (with refuse_suspect_workers it gets no admission and its "
        "submissions are refused).",
    )
    proof_failures: Count = Field(
        default=0, description="Wrong or late answers to weight challenges since registration."
    )


HEX_NONCE = r"^[0-9a-f]{64}$"


class WeightChallenge(WireModel):
    """A weight challenge (in a heartbeat answer): prove that the weights served at ``version``
    are the trainer's by answering ``POST /v1/workers/{id}/proof`` before ``expires_at`` with
    :func:`deltarl.weightsync.proof.proof_answer` of the served tensors."""

    version: Version = Field(description="The version to prove (the one the worker reported).")
    nonce: str = Field(pattern=HEX_NONCE, description="32 random bytes (hex), used once.")
    chunk_bytes: int = Field(ge=1, le=1 << 20, description="Bytes per sampled chunk.")
    chunks: int = Field(ge=0, le=65_536, description="Chunks sampled; 0: the whole state.")
    expires_at: float = Field(description="Answers after this time (Unix s) are refused.")


class ProofAnswer(WireModel):
    """``POST /v1/workers/{worker_id}/proof`` body (worker role)."""

    nonce: str = Field(pattern=HEX_NONCE, description="The challenge's nonce.")
    answer: str = Field(
        pattern=HEX_NONCE, description="proof_answer(served weights, nonce, version, spec) (hex)."
    )


class ProofResult(WireModel):
    """Outcome of a weight proof."""

    worker_id: str = Field(description="The worker that answered.")
    version: Version = Field(description="The version the challenge was for.")
    verified: bool = Field(description="True when the answer was right (and in time).")


class HeartbeatAck(WireModel):
    """Answer to a heartbeat or a registration: what the worker should do next."""

    worker: WorkerInfo = Field(description="The worker as recorded after this call.")
    latest_version: Version | None = Field(description="Newest published version; None if none.")
    latest_anchor: Version | None = Field(description="Newest anchor version; None if none.")
    max_staleness: Count = Field(description="Samples older than latest - this are dropped.")
    heartbeat_interval_s: float = Field(description="Send the next heartbeat within this.")
    lost_after_s: float = Field(description="Silence after which the worker is marked lost.")
    challenge: WeightChallenge | None = Field(
        default=None,
        description="A weight challenge to answer (POST /v1/workers/{id}/proof) when the worker "
        "serves a version it has not proven yet; None otherwise.",
    )
