"""Builders shared by the coordinator tests."""

from __future__ import annotations

import hashlib
import time

from deltarl.services.coordinator.store import NewSubmission
from deltarl.services.schemas import (
    ObjectRef,
    Trajectory,
    TrajectoryGroup,
    VersionPublish,
    VersionRecord,
    encode_group,
)


def publish_body(version: int, kind: str | None = None, base: int | None = None) -> VersionPublish:
    kind = kind or ("anchor" if version == 0 else "delta")
    if kind == "delta" and base is None:
        base = version - 1
    return VersionPublish(
        version=version,
        kind=kind,  # type: ignore[arg-type]
        base_version=base if kind == "delta" else None,
        objects=[
            ObjectRef(key=f"{kind}s/v{version:06d}", size_bytes=1000 if kind == "delta" else 50_000)
        ],
        full_bytes=50_000,
        state_digest=f"digest{version}",
        base_digest=f"digest{base}" if kind == "delta" else None,
        trainer_step=version,
        published_at=1_700_000_000.0 + version,
    )


def record(version: int, kind: str | None = None, anchor: int = 0) -> VersionRecord:
    body = publish_body(version, kind)
    return VersionRecord(
        **body.model_dump(),
        recorded_at=time.time(),
        anchor_version=version if body.kind == "anchor" else anchor,
        bytes=body.total_bytes,
    )


def group(
    key: str,
    worker: str = "w1",
    vmin: int = 0,
    vmax: int | None = None,
    n: int = 2,
    reward: float = 0.5,
) -> TrajectoryGroup:
    vmax = vmin if vmax is None else vmax
    trajs = [
        Trajectory(
            tokens=[1, 2, 3, 40000 + i],
            logprobs=[0.0, 0.0, -0.5, -1.25],
            mask=[0, 0, 1, 1],
            prompt_len=2,
            reward=reward,
            signals={"greens": 0.2 * i},
            version_min=vmin,
            version_max=vmax,
        )
        for i in range(n)
    ]
    return TrajectoryGroup(
        idempotency_key=key, worker_id=worker, group_id=f"g-{key}", trajectories=trajs
    )


def submission(
    key: str, worker: str = "w1", vmin: int = 0, payload_extra: bytes = b""
) -> NewSubmission:
    g = group(key, worker, vmin)
    payload = encode_group(g) + payload_extra
    return NewSubmission(
        idempotency_key=key,
        worker_id=worker,
        group_id=g.group_id,
        version_min=g.version_min,
        version_max=g.version_max,
        num_trajectories=len(g.trajectories),
        num_tokens=g.num_tokens,
        mean_reward=g.mean_reward,
        payload_digest=hashlib.sha256(payload).hexdigest(),
        payload=payload,
    )
