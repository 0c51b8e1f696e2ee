"""The decoding child: same result and same errors as decoding in process, survives its death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from rollout_helpers import FakeTrainer, clone_state, same_bits, tiny_engine

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.sync.decode_process import DecodeProcess, DecodeProcessError, SharedMirror
from deltarl.rollout.sync.weights import WeightSync
from deltarl.weightsync.codec.formats import decode_delta, encode_delta
from deltarl.weightsync.delta import compute_delta
from deltarl.weightsync.digest import state_digests
from deltarl.weightsync.errors import BaseMismatchError, CorruptDeltaError
from deltarl.weightsync.reader import BucketReader
from deltarl.weightsync.sharding import layout_view


def _states(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    old = {
        "a": torch.randn(300, 70, generator=g).to(dtype),
        "b": torch.randn(1000, generator=g).to(dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
        "same": torch.randn(64, generator=g).to(dtype),
    }
    new = clone_state(old)
    for name in ("a", "b"):
        flat = new[name].view(-1)
        pick = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 50]
        flat[pick] = (flat[pick].float() * 1.01 + 1e-3).to(dtype)
    return old, new


@pytest.fixture(scope="module")
def child() -> Iterator[DecodeProcess]:
    """One child for the module (starting one imports torch and numba: seconds)."""
    dp = DecodeProcess(threads=2)
    yield dp
    dp.close()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_child_decodes_exactly_what_the_parent_would(
    child: DecodeProcess, dtype: torch.dtype
) -> None:
    old, new = _states(dtype)
    data = encode_delta(compute_delta(old, new), old)
    mirror = SharedMirror(old)
    try:
        assert same_bits(mirror.tensors, old)
        child.attach(mirror)
        got = child.decode(data, state_digests(old))
        want = decode_delta(data, old, base_digests=state_digests(old))
        assert (got.base_version, got.version) == (want.base_version, want.version)
        assert got.patches.keys() == want.patches.keys()
        for name, p in want.patches.items():
            q = got.patches[name]
            assert np.array_equal(q.index, p.index) and np.array_equal(q.value, p.value)
            assert q.value.dtype == p.value.dtype and q.index.flags.writeable
            assert (q.base_digest, q.result_digest, q.shape) == (
                p.base_digest,
                p.result_digest,
                p.shape,
            )
        assert got.changed == want.changed > 0
    finally:
        mirror.close()


def test_child_decodes_a_sharded_versions_part_against_row_views(child: DecodeProcess) -> None:
    """A part of a sharded version names row slices of the mirror's tensors: the child decodes
    it against the mirror under the version's layout, as the parent would in process."""
    old, new = _states(torch.bfloat16)
    del old["empty"], new["empty"]
    layout = ("a[0:120]", "a[120:300]", "b[0:1000]", "same[0:64]")
    before, after = layout_view(old, layout), layout_view(new, layout)
    mirror = SharedMirror(old)
    try:
        child.attach(mirror)
        for part in (("a[0:120]", "b[0:1000]"), ("a[120:300]", "same[0:64]")):
            base = {k: before[k].clone() for k in part}
            data = encode_delta(compute_delta(base, {k: after[k] for k in part}), base)
            got = child.decode(data, state_digests(base), layout=layout)
            want = decode_delta(data, base, base_digests=state_digests(base))
            assert got.patches.keys() == want.patches.keys() == set(part)
            for name, p in want.patches.items():
                assert np.array_equal(got.patches[name].index, p.index)
                assert np.array_equal(got.patches[name].value, p.value)
        assert got.changed == want.changed > 0
        with pytest.raises(BaseMismatchError):  # the slices' digests are checked as usual
            child.decode(data, {k: "0" * 32 for k in part}, layout=layout)
    finally:
        mirror.close()


def test_child_sees_the_mirror_patched_in_place(child: DecodeProcess) -> None:
    """After the parent patches the shared mirror, the next delta decodes against the new bits."""
    v0, v1 = _states(torch.bfloat16)
    v2 = clone_state(v1)
    v2["b"][:10] += 1.0
    mirror = SharedMirror(v0)
    try:
        child.attach(mirror)
        d1 = child.decode(encode_delta(compute_delta(v0, v1), v0), state_digests(v0))
        for name, t in v1.items():
            mirror.tensors[name].copy_(t)  # what WeightSync does with scatter_patch
        d2 = child.decode(encode_delta(compute_delta(v1, v2), v1), state_digests(v1))
        assert d1.changed > 0 and d2.patches["b"].changed == 10
    finally:
        mirror.close()


def test_errors_keep_their_class_and_message(child: DecodeProcess) -> None:
    old, new = _states(torch.bfloat16)
    data = encode_delta(compute_delta(old, new), old)
    mirror = SharedMirror(old)
    try:
        child.attach(mirror)
        with pytest.raises(BaseMismatchError, match="not the base"):
            child.decode(data, state_digests(new))
        broken = bytearray(data)
        broken[len(broken) // 3] ^= 0xFF
        with pytest.raises(CorruptDeltaError):
            child.decode(bytes(broken), state_digests(old))
        with pytest.raises(CorruptDeltaError):
            child.decode(data[: len(data) // 2], state_digests(old))
        assert child.decode(data, state_digests(old)).changed > 0  # still serving
    finally:
        mirror.close()


@pytest.mark.slow
def test_a_dead_child_is_replaced_and_a_broken_one_reported(child: DecodeProcess) -> None:
    old, new = _states(torch.bfloat16)
    data = encode_delta(compute_delta(old, new), old)
    mirror = SharedMirror(old)
    try:
        child.attach(mirror)
        assert child._proc is not None
        first = child._proc.pid
        os.kill(first, signal.SIGKILL)
        child._proc.wait()
        # found dead before a call: a fresh child maps the mirror again and serves the call
        assert child.decode(data, state_digests(old)).changed > 0
        assert child.alive and child._proc.pid != first
        # a child that dies in the middle of a request: reported, not a DeltaError
        child._kill()
        child._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.buffer.read(8); sys.exit(3)"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        with pytest.raises(DecodeProcessError, match="broke off"):
            child.decode(data, state_digests(old))
        assert child.decode(data, state_digests(old)).changed > 0  # and replaced again
    finally:
        mirror.close()


@pytest.mark.slow
def test_decode_without_a_mirror_is_refused() -> None:
    fresh = DecodeProcess()
    try:
        with pytest.raises(RuntimeError, match="attach"):
            fresh.decode(b"whatever", {})
    finally:
        fresh.close()


@pytest.mark.slow
def test_weightsync_follows_through_the_child_and_falls_back_when_it_fails(
    bucket: LocalBucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path's arrangement (host mirror + child) on CPU: bit-exact, and a failing child
    costs one in-process decode, not a sync."""
    trainer = FakeTrainer(bucket, clone_state(dict(tiny_engine(seed=1).named_parameters())))
    engine = tiny_engine(seed=2)
    ws = WeightSync(engine, BucketReader(bucket), host_mirror=True, decode_process=True)
    decoder = ws._decoder
    assert decoder is not None
    calls: list[str] = []
    real = decoder.decode

    def flaky(data: bytes, digests: dict[str, str], **kw: object) -> object:
        calls.append("child")
        if len(calls) == 2:
            raise DecodeProcessError("simulated: the child broke off")
        return real(data, digests, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(decoder, "decode", flaky)
    try:
        ws.sync_to()
        assert ws._shared is not None and ws._mirror is ws._shared.tensors
        for v in range(1, 4):
            trainer.step()
            report = ws.sync_to()
            assert report.version == v and not report.fell_back and not report.failures
            assert same_bits(dict(engine.named_parameters()), trainer.states[v])
            assert ws._mirror is not None and same_bits(ws._mirror, trainer.states[v])
        assert len(calls) == 3 and decoder.alive
    finally:
        ws.close()
    assert ws._shared is None and not decoder.alive


def test_decode_process_needs_a_host_mirror(bucket: LocalBucket) -> None:
    with pytest.raises(ValueError, match="host_mirror"):
        WeightSync(
            tiny_engine(seed=2), BucketReader(bucket), host_mirror=False, decode_process=True
        )
