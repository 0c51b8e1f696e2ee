"""Faults of the bucket and late workers.

Versions are published from the test process with the library's
:class:`~deltarl.weightsync.writer.BucketWriter` (the tiny model's bf16 weights, ~2% of
the elements moved per version, compact deltas) and recorded with the coordinator by hand, so a
test can damage an object *after* the bucket commit and *before* any worker hears of the
version. Coordinator, env server and rollout workers are real processes.

* scenario 4: a delta object corrupted (bytes flipped, same size), truncated, or deleted: the
  worker's fetch detects it (size or xxh3 against the manifest, or missing), logs it and reports
  it as its last error, plans around it through the version's anchor and ends verified;
* scenario 5: one worker frozen (SIGSTOP) while 50 versions are published and one started
  after them: both catch up through the planner, downloading exactly the bytes their plans
  promised (the worker logs planned and downloaded bytes of every sync; the planner run on the
  bucket's manifests from this process gives the same totals).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from faults.harness import (
    Cluster,
    FaultReport,
    assert_nothing_lost,
    sync_lines,
)

from deltarl.buckets.local import LocalBucket
from deltarl.trainer.publish.weights import coordinator_challenges
from deltarl.weightsync.anchor import encode_anchor
from deltarl.weightsync.codec.formats import FORMAT_TAGS, encode_delta
from deltarl.weightsync.delta import compute_delta
from deltarl.weightsync.digest import combine_digests, state_digests
from deltarl.weightsync.manifest import VersionManifest
from deltarl.weightsync.proof import ProofSpec, make_challenges
from deltarl.weightsync.reader import BucketReader
from deltarl.weightsync.writer import BucketWriter, NewObject

pytestmark = [pytest.mark.network, pytest.mark.slow]

LATE = 50


def step(state: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    """A new bf16 state: about ``density`` of each tensor's non-zero elements moved by one ULP
    (up or down, never across zero: no NaN, no infinity), like an optimizer step; cheap enough
    to publish 50 versions in a few seconds."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        bits = t.view(torch.int16).clone().reshape(-1)
        idx = torch.randint(bits.numel(), (max(1, int(bits.numel() * density)),), generator=g)
        idx = idx[(bits[idx] & 0x7FFF) != 0]  # never +-0 (one ULP below is a NaN pattern)
        bits[idx] += torch.randint(0, 2, idx.shape, generator=g).to(torch.int16) * 2 - 1
        out[name] = bits.view(t.shape).view(torch.bfloat16)
    return out


class Versions:
    """Publishes the tiny model's versions: bucket first, then the coordinator (separately)."""

    def __init__(self, cluster: Cluster, model_dir: Path) -> None:
        import transformers

        from deltarl.trainer.publish.weights import publishable_state

        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.state = {n: t.to(torch.bfloat16).clone() for n, t in publishable_state(model).items()}
        self.digests = state_digests(self.state)
        self.bucket = LocalBucket(cluster.bucket)
        self.publisher = BucketWriter(self.bucket, anchor_every=0)
        self.cluster = cluster
        self.version = -1
        self.states: dict[int, dict[str, torch.Tensor]] = {}  # for the weight challenges

    def publish(self, *, anchor: bool, delta: bool = True) -> VersionManifest:
        """Publish the next version to the bucket (not to the coordinator yet)."""
        version = self.version + 1
        objects: list[NewObject] = []
        if self.version < 0:
            new, digests = self.state, self.digests
        else:
            new = step(self.state, 0.02, seed=version)
            d = compute_delta(self.state, new, self.version, version, self.digests)
            digests = {n: p.result_digest for n, p in d.patches.items()}
            if delta:
                blob = encode_delta(d, self.state, "compact")
                objects.append(
                    NewObject(
                        "delta",
                        FORMAT_TAGS["compact"],
                        blob,
                        base_version=self.version,
                        base_digest=d.base_digest,
                        changed=d.changed,
                    )
                )
        if anchor:
            objects.insert(
                0, NewObject("anchor", "safetensors", encode_anchor(new, version, digests=digests))
            )
        manifest = self.publisher.publish(
            version,
            objects,
            state_digest=combine_digests(digests),
            numel=sum(t.numel() for t in new.values()),
            full_bytes=sum(t.numel() * t.element_size() for t in new.values()),
            step=version,
        )
        self.state, self.digests, self.version = new, digests, version
        self.states[version] = new
        return manifest

    def register(self, manifest: VersionManifest) -> None:
        """Record the version and hand over its weight challenges, as the trainer does."""
        self.cluster.client.publish_version(manifest)
        spec = ProofSpec()
        pairs = make_challenges(self.states[manifest.version], manifest.version, spec, 4)
        coordinator_challenges(self.cluster.client)(manifest.version, spec, pairs)

    def next(self, *, anchor: bool = False) -> VersionManifest:
        manifest = self.publish(anchor=anchor)
        self.register(manifest)
        return manifest


@pytest.fixture(scope="module")
def published(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[tuple[Cluster, Versions]]:
    c = Cluster(
        tmp_path_factory.mktemp("faults-bucket"),
        model_dir,
        # no trainer drains the queue here: room for every group the workers play
        coordinator_settings={"target_queue_groups": 1000},
    )
    try:
        c.start_coordinator()
        c.start_env()
        c.start_worker("b1")
        versions = Versions(c, model_dir)
        versions.next(anchor=True)  # v0
        versions.next()  # v1
        c.wait_verified("b1", 1, timeout=90)
        yield c, versions
    finally:
        c.close()


def damage(bucket: Path, key: str, how: str) -> None:
    path = bucket / key
    data = path.read_bytes()
    if how == "corrupt":  # same size, bytes flipped in the middle
        mid = len(data) // 2
        path.write_bytes(
            data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 16]) + data[mid + 16 :]
        )
    elif how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.unlink()


EXPECTED = {
    "corrupt": "does not match the manifest's",
    "truncate": "the manifest says",
    "delete": "is missing from",
}


@pytest.mark.parametrize("how", ["corrupt", "truncate", "delete"])
def test_damaged_delta_recovered_through_anchor(
    published: tuple[Cluster, Versions], fault_report: FaultReport, how: str
) -> None:
    """The next version's delta is damaged in the bucket before the worker hears of it: the
    worker detects it, says so in its log and its last error, loads the version's anchor
    instead, and ends verified at that version."""
    c, versions = published
    wid = "b1"
    log = c.workers[wid].log
    start = c.wait_verified(wid, versions.version, timeout=60)
    before = c.ledger()
    n_lines = len(sync_lines(log))
    manifest = versions.publish(anchor=True)
    delta = next(o for o in manifest.objects if o.kind == "delta")
    damage(c.bucket, delta.key, how)
    versions.register(manifest)
    after = c.wait_verified(wid, manifest.version, timeout=60)
    # a group played with the recovered weights is accepted (and audited below)
    c.wait_submitted(wid, after.submitted)

    text = log.read_text(errors="replace")
    detected = [
        line
        for line in text.splitlines()
        if delta.key in line and "planning around it" in line and EXPECTED[how] in line
    ]
    reported = [line for line in text.splitlines() if "reached around 1 failed object" in line]
    syncs = [s for s in sync_lines(log)[n_lines:] if s["to"] == manifest.version]
    via_anchor = f"weights at v{manifest.version} via anchor" in text
    values = c.losses(before) | {
        "fault": f"{how} the delta {delta.key} of v{manifest.version}",
        "detected_in_log": detected[:1],
        "reported_as_last_error": bool(reported),
        "recovered_via_anchor": via_anchor,
        "sync": syncs,
        "weights_verified": after.weights_verified,
        "worker_version": f"v{start.applied_version} -> v{after.applied_version}",
        "undetected": int(not detected),
        "not_recovered_via_anchor": int(not via_anchor),
    }
    assert_nothing_lost(fault_report, f"delta_{how}", values)
    assert detected and reported and via_anchor, values
    assert syncs and syncs[-1]["failures"] == 1, syncs
    assert after.weights_digest == manifest.state_digest


def test_workers_fifty_versions_late_download_what_the_plan_promised(
    published: tuple[Cluster, Versions], fault_report: FaultReport
) -> None:
    """b1 is frozen at an anchored version while 50 more are published, then thawed: it
    follows the delta chain. b2 starts after them from nothing: anchor + 50 deltas. Both
    download exactly the bytes of the bucket's plan and end verified."""
    c, versions = published
    base = versions.next(anchor=True).version
    c.wait_verified("b1", base, timeout=60)
    b1 = c.workers["b1"]
    os.killpg(b1.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(LATE):
            versions.next()
    finally:
        os.killpg(b1.proc.pid, signal.SIGCONT)
    final = versions.version
    assert final == base + LATE
    b2 = c.start_worker("b2", seed=5)
    for wid in ("b1", "b2"):
        w = c.wait_verified(wid, final, timeout=90)
        c.wait_submitted(wid, w.submitted)  # and plays with those weights

    reader = BucketReader(versions.bucket)  # the plan a worker makes, from the manifests
    chain = reader.plan(base, final)  # b1: the 50 deltas
    fresh = reader.plan(None, final)  # b2: the anchor at `base` + the 50 deltas
    assert len(chain.steps) == LATE and not chain.uses_anchor, chain
    assert len(fresh.steps) == LATE + 1 and fresh.steps[0].version == base, fresh
    # b1's syncs past `base` (its heartbeat may report `base` verified before the sync to it
    # logs its bytes, so lines are chosen by version, not by position in the log)
    b1_lines = [s for s in sync_lines(b1.log) if s["to"] > base]
    b2_lines = sync_lines(b2.log)
    planned_b1 = sum(s["planned"] or 0 for s in b1_lines)
    downloaded_b1 = sum(s["downloaded"] or 0 for s in b1_lines)
    planned_b2 = sum(s["planned"] or 0 for s in b2_lines)
    downloaded_b2 = sum(s["downloaded"] or 0 for s in b2_lines)
    values = c.losses() | {
        "fault": f"b1 frozen while {LATE} versions were published; b2 started {LATE} versions late",
        "b1": {
            "from": base,
            "to": final,
            "syncs": len(b1_lines),
            "plan_bytes": chain.total_bytes,
            "planned_bytes": planned_b1,
            "downloaded_bytes": downloaded_b1,
        },
        "b2": {
            "from": None,
            "to": final,
            "syncs": len(b2_lines),
            "plan_bytes": fresh.total_bytes,
            "planned_bytes": planned_b2,
            "downloaded_bytes": downloaded_b2,
            "full_model_bytes": fresh.steps[0].size,
        },
        "bytes_not_as_planned": abs(downloaded_b1 - chain.total_bytes)
        + abs(planned_b1 - chain.total_bytes)
        + abs(downloaded_b2 - fresh.total_bytes)
        + abs(planned_b2 - fresh.total_bytes),
        "sync_failures": sum(int(s["failures"] or 0) for s in b1_lines + b2_lines),
    }
    assert_nothing_lost(fault_report, "fifty_versions_late", values)
    assert values["bytes_not_as_planned"] == 0 and values["sync_failures"] == 0, values
    for wid in ("b1", "b2"):
        w = c.worker(wid)
        assert w is not None and w.weights_digest == c.client.get_version(final).state_digest
