"""Pieces of the sharded publisher's fast path that run without torchrun: the delta built from
separately computed changes and digests, the host mirror, the per-rank thread default."""

from __future__ import annotations

import pytest
import torch

from deltarl.trainer.publish.sharded import _HostMirror, default_codec_threads, delta_from_changes
from deltarl.weightsync import compute_delta
from deltarl.weightsync.codec.compact import encode_compact
from deltarl.weightsync.delta import changed_elements
from deltarl.weightsync.digest import state_digests, tensor_digest


def _rows(
    seed: int, device: str = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    old = {
        "w[0:40]": (torch.randn(40, 33, generator=g) * 0.02).to(torch.bfloat16),
        "emb[8:20]": (torch.randn(12, 64, generator=g) * 0.02).to(torch.bfloat16),
        "norm[0:7]": torch.ones(7, dtype=torch.bfloat16),  # unchanged
    }
    new = {}
    for k, t in old.items():
        f = t.float()
        if not k.startswith("norm"):
            f = f + torch.randn(f.shape, generator=g) * 1e-3 * (
                torch.rand(f.shape, generator=g) < 0.2
            )
        new[k] = f.to(torch.bfloat16)
    return (
        {k: v.to(device) for k, v in old.items()},
        {k: v.to(device) for k, v in new.items()},
    )


def test_the_publishers_delta_encodes_to_the_bytes_of_compute_delta() -> None:
    old, new = _rows(0)
    want = compute_delta(old, new, 4, 5)
    changes = {k: changed_elements(old[k], new[k]) for k in new}
    got = delta_from_changes(changes, new, state_digests(old), state_digests(new), 4, 5)
    assert got.changed == want.changed > 0
    assert encode_compact(got, old, threads=2) == encode_compact(want, old, threads=2)


def test_cpu_rows_are_their_own_mirror() -> None:
    _, new = _rows(1)
    m = _HostMirror()
    m.start(new, torch.bfloat16)
    for t in new.values():
        host, ready = m.copy(t)
        assert host is t and ready is None
    assert m.host_bytes == 0


def test_threads_default_to_this_ranks_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = default_codec_threads()
    assert one == max(1, min(32, cores))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))
    assert default_codec_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_codec_threads() == max(1, min(32, cores // 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_mirror_copies_hashes_and_reuses_one_buffer() -> None:
    from deltarl.trainer.publish.sharded import _digest_when_ready

    old, new = _rows(2, "cuda")
    m = _HostMirror()
    first = {}
    for rows in (old, new):
        m.start(rows, torch.bfloat16)
        for k in sorted(rows):
            host, ready = m.copy(rows[k])
            assert host.device.type == "cpu" and host.is_pinned()
            assert _digest_when_ready(host, ready) == tensor_digest(rows[k])
            assert torch.equal(host, rows[k].cpu())
            first.setdefault(k, host.data_ptr())
            assert host.data_ptr() == first[k]  # the same buffer every version
    assert m.host_bytes == sum(t.numel() * 2 for t in old.values())
    m.settle()
