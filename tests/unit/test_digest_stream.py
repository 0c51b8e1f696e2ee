"""Device tensors are hashed in pieces through two staging buffers (``weightsync.digest``): the
pieces must be the tensor's bytes in C order, whatever its shape, strides or dtype, so the
digest equals the one of a plain copy to the CPU. Run here on CPU tensors with small buffers;
the GPU path differs only in where the copies come from and their events."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from deltarl.weightsync import digest
from deltarl.weightsync.codec.bits import dtype_name

ROOT = Path(__file__).resolve().parents[2]


def _streamed(t: torch.Tensor, piece_bytes: int) -> str:
    h = xxhash.xxh3_128()
    h.update(f"{dtype_name(t.dtype)}{list(t.shape)}".encode())
    bufs = (
        torch.empty(piece_bytes, dtype=torch.uint8),
        torch.empty(piece_bytes, dtype=torch.uint8),
    )
    digest._stream(h, t, bufs)
    return h.hexdigest()


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    experts = torch.randn(4, 6, 10, generator=g).to(torch.bfloat16)
    return [
        experts,  # rows of 120 bytes: several rows per piece
        torch.randn(7, 33, generator=g),  # rows that straddle pieces
        torch.randn(1000, generator=g).to(torch.float16),  # one dimension
        experts.transpose(1, 2),  # not contiguous
        experts[:, ::2],  # a strided view
        torch.randn(3, 2, 200, generator=g),  # rows larger than a piece: split by their rows
        torch.empty(0, 5),
    ]


@pytest.mark.parametrize("piece_bytes", [64, 100, 4096])
def test_streamed_digest_equals_a_plain_copy(piece_bytes: int) -> None:
    for t in _tensors():
        assert _streamed(t, piece_bytes) == digest.tensor_digest(t), (list(t.shape), t.stride())


def test_pieces_cover_the_bytes_in_order() -> None:
    t = torch.arange(2 * 3 * 50, dtype=torch.int16).reshape(2, 3, 50)
    pieces = list(digest._pieces(t, 64))
    assert max(p.numel() for p in pieces) <= 64
    assert torch.equal(torch.cat(pieces), t.reshape(-1).view(torch.uint8))


def test_a_changed_element_changes_the_streamed_digest() -> None:
    t = torch.randn(8, 16, 16)
    before = _streamed(t, 256)
    t[5, 3, 7] = t[5, 3, 7].item() + 1
    assert _streamed(t, 256) != before


@pytest.mark.gpu
def test_a_large_cuda_tensor_streams_to_the_cpu_digest() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(1)
    cpu = torch.randn(16, 1536, 2048, generator=g).to(torch.bfloat16)  # 96 MiB: streamed
    dev = cpu.cuda()
    assert cpu.numel() * cpu.element_size() > digest.STREAM_BYTES
    assert digest.tensor_digest(dev) == digest.tensor_digest(cpu)
    assert digest.tensor_digest(dev.transpose(1, 2)) == digest.tensor_digest(cpu.transpose(1, 2))


def test_digests_on_threads_equal_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "DIGEST_THREADS", 3)
    monkeypatch.setattr(digest, "PARALLEL_BYTES", 1)  # these small tensors go to the threads
    state = {f"t{i}": t for i, t in enumerate(_tensors())}
    serial = {n: digest.tensor_digest(t) for n, t in state.items()}
    threaded = digest.state_digests(state)
    assert threaded == serial and list(threaded) == list(state)
    assert digest.state_digests(state) == serial


def test_a_forked_child_gets_its_own_digest_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # a child forked from a process with the pool inherits it without its threads: using it
    # would wait forever, so the pool is made again when the process id differs
    pool = digest._executor()
    assert digest._executor() is pool
    monkeypatch.setattr(digest.os, "getpid", lambda: -1)
    other = digest._executor()
    assert other is not pool
    assert other.submit(lambda: 7).result(timeout=10) == 7


@pytest.mark.gpu
def test_cuda_tensors_on_threads_equal_their_cpu_digests() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(2)
    cpu = {f"e{i}": torch.randn(8, 1536, 2048, generator=g).to(torch.bfloat16) for i in range(4)}
    dev = {n: t.to(f"cuda:{torch.cuda.device_count() - 1}") for n, t in cpu.items()}
    assert digest.state_digests(dev) == digest.state_digests(cpu)


def test_digest_bench_compares_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "digest.json"
    cmd = [sys.executable, str(ROOT / "bench" / "digest_bench.py"), "--device", "cpu"]
    cmd += ["--tensors", "3", "--shape", "4,64,64", "--repeats", "2", "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    d = json.loads(out.read_text())
    assert d["bytes"] == 3 * 4 * 64 * 64 * 2
    assert set(d["ways"]) == {"one_at_a_time", "threads"}
    assert all(len(w["seconds"]) == 2 and w["median_s"] > 0 for w in d["ways"].values())
