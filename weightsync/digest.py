"""Digests that prove two sets of weights are bit-identical.

A *tensor digest* is the xxh3-128 of the tensor's raw little-endian bytes in C order, prefixed with
its dtype and shape so that a reshape or a cast can never collide with the original. A *state
digest* combines the tensor digests of a whole state dict in name order. Both are lowercase hex.
xxh3 is not a cryptographic hash: it detects corruption and mistakes (wrong base, partial apply,
truncated download), not an adversary; signed manifests are the answer to untrusted buckets.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from deltarl.weightsync.codec.bits import dtype_name

# A device tensor larger than this is hashed in pieces of about this size, each copied into one of
# two pinned host buffers while the previous piece is hashed: the copy overlaps the hash, and no
# host copy (or device-side contiguous copy) of the whole tensor is made. A stacked expert tensor
# of Qwen3-30B-A3B is 800 MB; .cpu() of it (pageable memory, one tensor after another) ran at
# ~1.3 GB/s on an H200 host.
STREAM_BYTES = 64 << 20

_staging = threading.local()

# Tensors are hashed on this many threads at once (xxhash releases the GIL; a device tensor's
# copies overlap other tensors' hashing): one thread hashes ~7 GB/s, a 61 GB model's
# verification took 10-11 s serially. Below PARALLEL_BYTES in all, one thread does it.
DIGEST_THREADS = max(1, min(8, os.cpu_count() or 1))
PARALLEL_BYTES = 64 << 20
_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-128 hex digest of ``t``'s dtype, shape and bytes (device tensors are streamed
    through pinned host memory: the same digest as a copy to the CPU)."""
    h = xxhash.xxh3_128()
    h.update(f"{dtype_name(t.dtype)}{list(t.shape)}".encode())
    data = t.detach()
    if data.device.type == "cuda" and data.numel() * data.element_size() > STREAM_BYTES:
        _stream(h, data, _buffers())
        return h.hexdigest()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous().reshape(-1)
    if data.numel():
        h.update(data.view(torch.uint8).numpy().data)
    return h.hexdigest()


def _buffers() -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's two pinned staging buffers (allocated once: pinning is slow)."""
    bufs = getattr(_staging, "bufs", None)
    if bufs is None:
        bufs = tuple(torch.empty(STREAM_BYTES, dtype=torch.uint8, pin_memory=True) for _ in "ab")
        _staging.bufs = bufs
    return bufs


def _pieces(data: torch.Tensor, piece_bytes: int) -> Iterator[torch.Tensor]:
    """``data``'s bytes in C order as uint8 pieces of at most ``piece_bytes`` (whole rows of the
    first dimension, recursively: a row larger than a piece is split by its own rows)."""
    if data.dim() <= 1 or data.numel() * data.element_size() <= piece_bytes:
        flat = data.contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), piece_bytes):
            yield flat[start : start + piece_bytes]
        return
    row_bytes = data[0].numel() * data.element_size()
    if row_bytes > piece_bytes:
        for row in data:
            yield from _pieces(row, piece_bytes)
        return
    rows = max(1, piece_bytes // row_bytes)
    for start in range(0, data.shape[0], rows):
        yield data[start : start + rows].contiguous().reshape(-1).view(torch.uint8)


def _stream(h: xxhash.xxh3_128, data: torch.Tensor, bufs: tuple[torch.Tensor, ...]) -> None:
    """Feed ``data``'s bytes (C order) to ``h``: piece k is copied into ``bufs[k % 2]`` without
    blocking while piece k - 1 is hashed (its copy waited for by its event)."""
    piece_bytes = bufs[0].numel()
    pending: tuple[torch.cuda.Event | None, torch.Tensor] | None = None
    for k, piece in enumerate(_pieces(data, piece_bytes)):
        dst = bufs[k % 2][: piece.numel()]
        dst.copy_(piece, non_blocking=True)
        event = None
        if piece.device.type == "cuda":
            # on the copy's stream: the piece's device, whichever device this thread is on
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(piece.device))
        if pending is not None:
            _hash_when_done(h, *pending)
        pending = (event, dst)
    if pending is not None:
        _hash_when_done(h, *pending)


def _hash_when_done(h: xxhash.xxh3_128, event: torch.cuda.Event | None, buf: torch.Tensor) -> None:
    if event is not None:
        event.synchronize()
    h.update(buf.numpy().data)


def combine_digests(digests: Mapping[str, str]) -> str:
    """State digest from per-tensor digests (order-independent: names are sorted)."""
    h = xxhash.xxh3_128()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name]}\n".encode())
    return h.hexdigest()


def state_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """:func:`tensor_digest` of every tensor, on :data:`DIGEST_THREADS` threads when there is
    enough to hash (the same digests as one at a time)."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if DIGEST_THREADS == 1 or len(tensors) < 2 or total < PARALLEL_BYTES:
        return {name: tensor_digest(t) for name, t in tensors.items()}
    names = list(tensors)
    # largest first, so that one big tensor does not start last and finish alone
    order = sorted(names, key=lambda n: -tensors[n].numel() * tensors[n].element_size())
    done = dict(
        zip(order, _executor().map(lambda n: tensor_digest(tensors[n]), order), strict=True)
    )
    return {name: done[name] for name in names}


def _executor() -> ThreadPoolExecutor:
    """The digest threads (each keeps its pinned buffers), made again in a forked child, which
    inherits the pool but not its threads."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="digest"))
        return _pool[1]


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    return combine_digests(state_digests(state))
