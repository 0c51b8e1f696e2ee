"""Builders shared by the coordinator tests."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime

from deltarl.services.coordinator.schemas import (
    ObjectRef,
    Trajectory,
    TrajectoryGroup,
    VersionManifest,
    VersionRecord,
    encode_group,
)
from deltarl.services.coordinator.store import NewSubmission
from deltarl.services.coordinator.versions import summarize
from deltarl.weightsync.manifest import version_tag


def digest(version: int) -> str:
    return f"{version + 1:032x}"


def manifest(
    version: int,
    base: int | None = None,
    anchor: bool | None = None,
    delta_size: int = 1000,
    anchor_size: int = 50_000,
    bases: tuple[int, ...] = (),
) -> VersionManifest:
    """A manifest with a delta from ``base`` (default version-1) and/or an anchor."""
    tag = version_tag(version)
    anchor = version == 0 if anchor is None else anchor
    objects = []
    if anchor:
        objects.append(
            ObjectRef(
                key=f"objects/{tag}/a.safetensors",
                kind="anchor",
                format="safetensors",
                size=anchor_size,
                xxh3_128="0" * 32,
                version=version,
                result_digest=digest(version),
            )
        )
    delta_bases = list(bases) or (
        [] if version == 0 or base == -1 else [version - 1 if base is None else base]
    )
    for b in delta_bases:
        objects.append(
            ObjectRef(
                key=f"objects/{tag}/d{b}.dlt",
                kind="delta",
                format="deltarl-compact-v1",
                size=delta_size * (version - b),
                xxh3_128="1" * 32,
                version=version,
                base_version=b,
                base_digest=digest(b),
                result_digest=digest(version),
                changed=10,
            )
        )
    return VersionManifest(
        version=version,
        step=version,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        state_digest=digest(version),
        numel=25_000,
        full_bytes=50_000,
        objects=tuple(objects),
    )


def record(version: int, kind: str | None = None, anchor: int = 0) -> VersionRecord:
    m = manifest(version, anchor=(kind == "anchor") if kind else None)
    return summarize(m, None, time.time())


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
