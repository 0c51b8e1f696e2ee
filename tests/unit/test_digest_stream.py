"""Device tensors are hashed in pieces through two staging buffers (``weightsync.digest``): the
pieces must be the tensor's bytes in C order, whatever its shape, strides or dtype, so the
digest equals the one of a plain copy to the CPU. Run here on CPU tensors with small buffers;
the GPU path differs only in where the copies come from and their events."""

from __future__ import annotations

import pytest
import torch
import xxhash

from deltarl.weightsync import digest
from deltarl.weightsync.codec.bits import dtype_name


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
