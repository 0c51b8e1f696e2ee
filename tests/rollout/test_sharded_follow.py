"""A worker following a sharded version (one part per trainer rank) decodes its parts at once on
one pool of threads: the result is bit-exact, and a part that does not decode against the local
weights fails the delta (nothing applied), after which the worker recovers through an anchor."""

from __future__ import annotations

import math

import pytest
import torch
from rollout_helpers import same_bits

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.sync import weights as weights_module
from deltarl.rollout.sync.weights import WeightSync
from deltarl.weightsync.anchor import encode_anchor
from deltarl.weightsync.codec.formats import FORMAT_TAGS, encode_delta
from deltarl.weightsync.delta import compute_delta
from deltarl.weightsync.digest import combine_digests, state_digests
from deltarl.weightsync.manifest import slice_key
from deltarl.weightsync.reader import BucketReader
from deltarl.weightsync.writer import BucketWriter, NewObject

RANKS = 4
ROWS = 8


class Tensors:
    """The part of an engine that WeightSync uses: named CPU tensors."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.device = torch.device("cpu")
        self.tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return self.tensors


def rows_of(state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    per = ROWS // RANKS
    lo, hi = rank * per, (rank + 1) * per
    return {slice_key(n, lo, hi): t[lo:hi].clone() for n, t in state.items()}


def publish(writer: BucketWriter, version: int, state, base=None) -> None:
    """``version`` of ``state`` as the ranks of a sharded trainer publish it: an anchor part
    per rank, or (with ``base``) a delta part per rank against the base's rows."""
    digests: dict[str, str] = {}
    base_digests: dict[str, str] = {}
    parts, changed = [], 0
    for r in range(RANKS):
        rows = rows_of(state, r)
        digests.update(state_digests(rows))
        if base is None:
            blob = encode_anchor(rows, version, digests=state_digests(rows))
            parts.append(writer.upload_part(version, "safetensors", blob, sorted(rows)))
            continue
        old = rows_of(base, r)
        base_digests.update(state_digests(old))
        delta = compute_delta(old, rows, version - 1, version)
        changed += delta.changed
        blob = encode_delta(delta, old, "compact", positions="gaps")
        parts.append(writer.upload_part(version, FORMAT_TAGS["compact"], blob, sorted(rows)))
    obj = (
        NewObject("anchor", "safetensors", tuple(parts))
        if base is None
        else NewObject(
            "delta",
            FORMAT_TAGS["compact"],
            tuple(parts),
            base_version=version - 1,
            base_digest=combine_digests(base_digests),
            changed=changed,
        )
    )
    numel = sum(t.numel() for t in state.values())
    writer.publish(
        version, [obj], state_digest=combine_digests(digests), numel=numel, full_bytes=2 * numel
    )


@pytest.fixture
def versions(tmp_path) -> tuple[LocalBucket, list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)
    v0 = {f"w{i}": (torch.randn(ROWS, 300, generator=g) * 0.02).bfloat16() for i in range(6)}
    v1 = {}
    for n, t in v0.items():
        moved = torch.rand(t.shape, generator=g) < 0.05
        v1[n] = torch.where(moved, (t.view(torch.int16) + 1).view(torch.bfloat16), t)
    bucket = LocalBucket(tmp_path / "bucket")
    writer = BucketWriter(bucket, anchor_every=0)
    publish(writer, 0, v0)
    publish(writer, 1, v1, base=v0)
    return bucket, [v0, v1]


def test_the_parts_decode_at_once_to_the_trainers_rows(versions, monkeypatch) -> None:
    bucket, states = versions
    at_once = []
    real = WeightSync._decode_part

    def counting(self, *args, **kwargs):
        at_once.append(kwargs.get("pool") or args[-1])  # the shared pool each part decodes on
        return real(self, *args, **kwargs)

    monkeypatch.setattr(WeightSync, "_decode_part", counting)
    engine = Tensors({n: tuple(t.shape) for n, t in states[0].items()})
    sync = WeightSync(engine, BucketReader(bucket))  # type: ignore[arg-type]
    sync.sync_to(0)
    report = sync.sync_to(1)
    assert [s.kind for s in report.steps] == ["delta"]
    assert same_bits(engine.tensors, states[1])
    assert len(at_once) == RANKS and len({id(p) for p in at_once}) == 1
    assert weights_module.PART_DECODERS > 1
    assert sync.verified_digest() is not None and sync.verified_digest()[0] == 1


def test_a_part_that_does_not_decode_fails_the_delta_and_an_anchor_recovers(versions) -> None:
    bucket, states = versions
    engine = Tensors({n: tuple(t.shape) for n, t in states[0].items()})
    sync = WeightSync(engine, BucketReader(bucket))  # type: ignore[arg-type]
    sync.sync_to(0)
    with torch.no_grad():  # silent drift in the third rank's rows: other old exponents there
        engine.tensors["w2"][4:6] *= 64
    report = sync.sync_to(1)
    assert report.failures and "w2[4:6]" in report.failures[0], report.failures
    assert [s.kind for s in report.steps] == ["anchor", "delta"]  # reloaded, then applied
    assert sync.healthy and same_bits(engine.tensors, states[1])
    assert math.isfinite(report.steps[-1].decode_s)
