"""Weight proofs: a keyed digest of a nonce-chosen sample of the weights, which only a holder of
the weights can compute.

Why: a worker's self-reported state digest is public (``GET /v1/versions/{v}`` shows it), so a
worker could copy it without holding any weights. A proof is an answer to a fresh challenge:

1. the trainer, right after publishing version ``v``, draws random nonces and computes for each
   the answer on its own state of ``v`` (:func:`proof_answer`), and hands the (nonce, answer)
   pairs to the coordinator, which never shows the answers to anyone;
2. the coordinator sends a worker that serves ``v`` one unused nonce (in a heartbeat answer);
3. the worker computes the answer on the tensors its engine actually serves and sends it back;
   a correct answer to that nonce, within its time limit, is what sets ``weights_verified``.

The answer (``deltarl-proof-v1``) is BLAKE2b-256 keyed with the 32-byte nonce over:

* ``b"deltarl-proof-v1\\0"``, the version (8 bytes, little-endian), ``chunk_bytes`` and
  ``chunks`` (4 bytes each), the total byte length ``N`` of the state (8 bytes);
* the layout: for each tensor in sorted name order, its name (UTF-8), ``\\0``, its dtype
  (``str(torch.dtype)``), ``\\0``, its shape as decimal numbers joined by ``,``, ``\\n``;
* the sample: the state's bytes are the tensors' raw bytes (C order, native little-endian) in
  sorted name order, cut into ``n = ceil(N / chunk_bytes)`` chunks. With ``chunks = 0`` every
  chunk is hashed in order (the whole state). Otherwise chunk ``j`` for ``j`` in
  ``0..chunks-1`` is chunk number ``int.from_bytes(BLAKE2b-64(nonce || b"chunk" ||
  j as 4 bytes LE), "little") mod n`` (drawn with replacement); each is hashed as its start
  offset (8 bytes LE) followed by its bytes (the last chunk may be short).

Strength: without the bytes of the sampled chunks there is nothing to compute the answer from
(a keyed hash; the nonce is fresh and used once). A worker that holds a wrong state fails when
any sampled chunk differs: a stale version differs from the current one in most chunks (a 1%
sparse delta touches nearly every 4 KiB chunk), so one proof catches it; a state wrong in a
fraction ``f`` of its chunks passes a sampled proof with probability ``(1 - f) ** chunks``;
``chunks = 0`` (the whole state) leaves no such gap, at the cost of hashing everything.

Cost of a sampled proof: ``chunks`` slices gathered on the tensors' device, one copy of
``chunks * chunk_bytes`` bytes (1 MiB by default) to the host, and one hash: a few milliseconds
for any model size, so a 7B worker can prove every version.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import secrets
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

MAGIC = b"deltarl-proof-v1\0"
NONCE_BYTES = 32
DEFAULT_CHUNK_BYTES = 4096
DEFAULT_CHUNKS = 256
MAX_CHUNKS = 65_536
MAX_CHUNK_BYTES = 1 << 20


class ProofError(ValueError):
    """A proof cannot be computed (e.g. an empty state or a bad spec)."""


@dataclass(frozen=True, slots=True)
class ProofSpec:
    """What a proof samples: ``chunks`` chunks of ``chunk_bytes`` (``chunks = 0``: all)."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    chunks: int = DEFAULT_CHUNKS

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ProofError(f"chunk_bytes must be within 1..{MAX_CHUNK_BYTES}")
        if not 0 <= self.chunks <= MAX_CHUNKS:
            raise ProofError(f"chunks must be within 0..{MAX_CHUNKS} (0: the whole state)")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as a flat uint8 tensor on its device (no copy when contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8)


def chunk_numbers(nonce: bytes, n_chunks: int, chunks: int) -> list[int]:
    """The chunk numbers a nonce selects (see the module docstring)."""
    return [
        int.from_bytes(
            hashlib.blake2b(nonce + b"chunk" + struct.pack("<I", j), digest_size=8).digest(),
            "little",
        )
        % n_chunks
        for j in range(chunks)
    ]


Piece = tuple[str, int, int]
"""Bytes ``lo..hi-1`` of the raw bytes of tensor ``name``."""


def _layout(
    meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
) -> tuple[list[str], list[int]]:
    names = sorted(meta)
    if not names:
        raise ProofError("cannot prove an empty state")
    sizes = []
    for n in names:
        dtype, shape = meta[n]
        numel = 1
        for d in shape:
            numel *= d
        sizes.append(numel * (1 if dtype == torch.bool else dtype.itemsize))
    if sum(sizes) == 0:
        raise ProofError("cannot prove a state of zero bytes")
    return names, sizes


def sampled_pieces(
    meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], nonce: bytes, spec: ProofSpec
) -> list[tuple[int, list[Piece]]]:
    """The chunks a sampled proof hashes, in order: (start offset, the tensor byte ranges it
    crosses). ``meta``: dtype and shape of every tensor of the state."""
    if spec.chunks == 0:
        raise ProofError("a whole-state proof (chunks = 0) samples no pieces")
    names, sizes = _layout(meta)
    total = sum(sizes)
    cb = spec.chunk_bytes
    starts = [0, *itertools.accumulate(sizes)]  # byte offset of each tensor, then the total
    out: list[tuple[int, list[Piece]]] = []
    for c in chunk_numbers(nonce, -(-total // cb), spec.chunks):
        lo, hi = c * cb, min((c + 1) * cb, total)
        pieces: list[Piece] = []
        start = lo
        # the tensors this byte range crosses (usually one); the last tensor starting at or
        # before ``lo`` is never an empty one (an empty one starts where the next does)
        i = bisect.bisect_right(starts, lo) - 1
        while lo < hi:
            end = min(hi, starts[i + 1])
            pieces.append((names[i], lo - starts[i], end - starts[i]))
            lo, i = end, i + 1
        out.append((start, pieces))
    return out


def answer_from(
    meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    nonce: bytes,
    version: int,
    spec: ProofSpec,
    chunks: list[bytes],
) -> str:
    """The answer from the bytes of the sampled chunks (``chunks[j]``: the bytes of chunk
    ``j`` of :func:`sampled_pieces`, or of every chunk in order when ``spec.chunks == 0``)."""
    if len(nonce) != NONCE_BYTES:
        raise ProofError(f"a nonce has {NONCE_BYTES} bytes, got {len(nonce)}")
    names, sizes = _layout(meta)
    h = hashlib.blake2b(key=nonce, digest_size=32)
    h.update(MAGIC + struct.pack("<QIIQ", version, spec.chunk_bytes, spec.chunks, sum(sizes)))
    for name in names:
        dtype, shape = meta[name]
        h.update(f"{name}\0{dtype}\0{','.join(str(d) for d in shape)}\n".encode())
    if spec.chunks == 0:
        for data in chunks:
            h.update(data)
        return h.hexdigest()
    for (start, _), data in zip(sampled_pieces(meta, nonce, spec), chunks, strict=True):
        h.update(struct.pack("<Q", start))
        h.update(data)
    return h.hexdigest()


def proof_answer(
    state: Mapping[str, torch.Tensor], nonce: bytes, version: int, spec: ProofSpec
) -> str:
    """The answer (hex) to ``nonce`` for ``state`` at ``version``; tensors may live on any
    device (the sampled bytes are gathered there and copied to the host once)."""
    if len(nonce) != NONCE_BYTES:
        raise ProofError(f"a nonce has {NONCE_BYTES} bytes, got {len(nonce)}")
    meta = {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}
    views = {n: _byte_view(t) for n, t in state.items()}
    if spec.chunks == 0:
        names, _ = _layout(meta)
        whole = [views[n].cpu().numpy().tobytes() for n in names]
        return answer_from(meta, nonce, version, spec, whole)
    sample = sampled_pieces(meta, nonce, spec)
    pieces = [views[n][lo:hi] for _, ps in sample for n, lo, hi in ps]
    by_device: dict[torch.device, list[int]] = {}
    for k, p in enumerate(pieces):
        by_device.setdefault(p.device, []).append(k)
    host: list[bytes] = [b""] * len(pieces)
    for ids in by_device.values():
        # one gather (cat) and one copy per device
        buf = torch.cat([pieces[k] for k in ids]).cpu().numpy().tobytes()
        at = 0
        for k in ids:
            n = int(pieces[k].numel())
            host[k] = buf[at : at + n]
            at += n
    chunks, k = [], 0
    for _, ps in sample:
        chunks.append(b"".join(host[k : k + len(ps)]))
        k += len(ps)
    return answer_from(meta, nonce, version, spec, chunks)


def make_challenges(
    state: Mapping[str, torch.Tensor],
    version: int,
    spec: ProofSpec,
    count: int,
    threads: int = 1,
) -> list[tuple[str, str]]:
    """``count`` fresh (nonce hex, answer hex) pairs for ``state`` at ``version``, computed in
    up to ``threads`` threads (the gathers and the hashing release the GIL)."""
    nonces = [new_nonce() for _ in range(count)]

    def answer(nonce: bytes) -> str:
        return proof_answer(state, nonce, version, spec)

    if threads <= 1 or count <= 1:
        answers = [answer(n) for n in nonces]
    else:
        with ThreadPoolExecutor(min(threads, count), thread_name_prefix="proof") as pool:
            answers = list(pool.map(answer, nonces))
    return [(n.hex(), a) for n, a in zip(nonces, answers, strict=True)]
