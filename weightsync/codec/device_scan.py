"""The compact encoder's O(n) pass, run where the weights are (a GPU), so the host gets O(changed).

Encoding a chunk of the compact format needs, besides the changed elements, each one's position
context (its old exponent) and its *rank*: how many earlier elements of the chunk share that
context (:func:`~.kernels.scan_contexts`, a sequential pass over every element). For an FSDP
rank of a 7B model that pass reads ~1.9 G elements per step on the CPU. Here it is a stable sort
of the chunk's contexts on the device: in (context, index) order an element's rank is its
position minus the number of elements of smaller contexts. Only the changed elements' contexts,
ranks and old values, and a 256-entry histogram per chunk, cross to the host
(:class:`~.compact_chunks.ChunkScan`); the encoder then never touches the base
(:func:`~.compact.encode_compact` ``scans=``), and its bytes are the same.

:func:`start_changes_and_scans` queues the work of one tensor and returns at once after one
synchronization (the number of changes per chunk); the results land in pinned host memory while
the caller queues the next tensor, and :meth:`PendingScan.result` waits for them. A delta whose
positions are coded as gaps needs no ranks (``ranks=False``): then only the changed elements'
contexts and old values are made, no chunk is sorted, and the scans carry no histogram or
ranks (at Qwen3-30B-A3B's size the sorts took ~0.6 s of a rank's ~3 s publish).
:func:`changes_and_scans` is both in one call. Pinned memory is slow to allocate (the pages are
locked, about a second per few GB), so a caller that scans every version reserves it once in a
:class:`PinnedStaging` and the results land there; without one (or past its end) they land in
torch's caching host allocator.

Works on any torch device (the tests run it on CPU against the numba kernel).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from deltarl.weightsync.codec.bits import bits_view, float_format
from deltarl.weightsync.codec.compact import DEFAULT_CHUNK_ELEMS
from deltarl.weightsync.codec.compact_chunks import POSITIONS, ChunkScan, context_layout

logger = logging.getLogger(__name__)

__all__ = [
    "SCAN_BYTES_PER_CHANGE",
    "PendingScan",
    "PinnedStaging",
    "changes_and_scans",
    "start_changes_and_scans",
    "warm_up",
]

# host bytes of one change's results: index (int64), new and old bits (int16), context (int16),
# rank (int32); plus a 256-entry int64 histogram per chunk with changes
SCAN_BYTES_PER_CHANGE = 18
_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class PinnedStaging:
    """Pinned host memory reserved ahead for the scans' results of one version at a time.

    :meth:`reserve` allocates (once, or larger); :meth:`reset` starts a version (every array
    handed out before is then reused: the caller must be done with the previous version's
    results); :meth:`take` hands out the next aligned slice, or None past the end (the caller
    then uses torch's caching host allocator), and :attr:`wanted` says how many bytes the
    version needed in all, so the next reservation can cover it. Where pinned memory cannot be
    had, nothing is reserved and every :meth:`take` answers None (correct, slower).
    """

    def __init__(self, pin: bool = True) -> None:
        self._pin = pin
        self._buf: torch.Tensor | None = None
        self._at = 0
        self.wanted = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def reserve(self, nbytes: int) -> None:
        """Hold at least ``nbytes`` (rounded up to 64 MiB); a smaller or equal size keeps the
        buffer."""
        if nbytes <= self.nbytes:
            return
        nbytes = -(-nbytes // (64 << 20)) * (64 << 20)
        self._buf = None  # free the old buffer first
        try:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        except RuntimeError as err:  # no pinned memory to be had
            logger.warning("pinned staging unavailable (%s)", err)

    def reset(self) -> None:
        self._at = 0
        self.wanted = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        size = numel * dtype.itemsize
        self.wanted = _aligned(self.wanted) + size
        start = _aligned(self._at)
        if self._buf is None or start + size > self._buf.numel():
            self._at = self.nbytes  # full: the rest of this version goes elsewhere
            return None
        self._at = start + size
        return self._buf[start : start + size].view(dtype)


def changes_and_scans(
    old: torch.Tensor,
    new: torch.Tensor,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    *,
    ranks: bool = True,
) -> tuple[np.ndarray, np.ndarray, dict[int, ChunkScan]]:
    """``(index, value, scans)``: the flat indices (int64) and new bit patterns of the elements
    whose bits differ (as :func:`~deltarl.weightsync.delta.changed_elements`), and the
    :class:`ChunkScan` of every chunk of ``chunk_elems`` elements with a change, by chunk start.

    ``old`` and ``new``: same dtype, shape and device. Transient device memory: about 16 bytes
    per element of one chunk (the contexts, the sort's keys and permutation, a mark per element).
    ``ranks=False``: scans without histograms or ranks, for positions coded as gaps.
    """
    return start_changes_and_scans(old, new, chunk_elems, ranks=ranks).result()


class PendingScan:
    """The changes and chunk scans of one tensor, on their way to the host; :meth:`result`
    waits for the copies (computed once)."""

    def __init__(
        self,
        parts: dict[str, torch.Tensor],
        used: list[tuple[int, int, int, int]],
        nctx: int,
        ready: Any,
    ) -> None:
        self._parts, self._used, self._nctx, self._ready = parts, used, nctx, ready
        self._result: tuple[np.ndarray, np.ndarray, dict[int, ChunkScan]] | None = None

    def result(self) -> tuple[np.ndarray, np.ndarray, dict[int, ChunkScan]]:
        """``(index, value, scans)`` as :func:`changes_and_scans` returns them."""
        if self._result is None:
            if self._ready is not None:
                self._ready.synchronize()
            p = {k: t.numpy() for k, t in self._parts.items()}
            ranked = "rank" in p
            hist = p["hist"].reshape(-1, self._nctx) if ranked and self._used else None
            scans = {
                start: ChunkScan(
                    count=count,
                    hist=None if hist is None else hist[j],
                    ctx=p["ctx"][lo:hi],
                    rank=p["rank"][lo:hi] if ranked else None,
                    old=p["old"][lo:hi],
                )
                for j, (start, count, lo, hi) in enumerate(self._used)
            }
            self._result = (p["index"].astype(np.int64, copy=False), p["value"], scans)
            self._parts = {}
        return self._result


def start_changes_and_scans(
    old: torch.Tensor,
    new: torch.Tensor,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    staging: PinnedStaging | None = None,
    *,
    ranks: bool = True,
) -> PendingScan:
    """Queue :func:`changes_and_scans` for one tensor on the current stream and return.

    One synchronization (the changes per chunk, a few bytes); on a GPU, the results are copied
    into pinned host memory behind the work (``staging``'s where it has room), so the caller
    may queue the next tensor (or overwrite ``old`` in place on the same stream) at once.
    ``ranks=False``: no chunk histograms or ranks (positions coded as gaps need neither)."""
    if old.dtype != new.dtype or old.shape != new.shape or old.device != new.device:
        raise ValueError(
            f"old and new differ: {old.dtype}{list(old.shape)} on {old.device} vs "
            f"{new.dtype}{list(new.shape)} on {new.device}"
        )
    if chunk_elems < 1:
        raise ValueError("chunk_elems must be positive")
    fmt = float_format(new.dtype)
    shift, emask = context_layout(fmt)
    if emask > 255:
        raise ValueError(f"{fmt.name}: more than 256 position contexts")
    nctx = emask + 1
    ob, nb = bits_view(old.contiguous()), bits_view(new.contiguous())
    n = ob.numel()
    mask = ob != nb
    full = n - n % chunk_elems
    per_chunk = []
    if full:
        per_chunk.append(mask[:full].view(-1, chunk_elems).sum(1))
    if full < n:
        per_chunk.append(mask[full:].sum().view(1))
    counts = torch.cat(per_chunk).tolist() if per_chunk else []  # the one synchronization
    k = int(sum(counts))
    tidx = _nonzero(mask, k)
    del mask
    used: list[tuple[int, int, int, int]] = []  # (start, count, lo, hi)
    hists: list[torch.Tensor] = []
    rank_parts: list[torch.Tensor] = []
    lo = 0
    for i, changes in enumerate(counts):
        if not changes:
            continue
        start = i * chunk_elems
        count = min(chunk_elems, n - start)
        if ranks:
            keys = ((ob[start : start + count] >> shift) & emask).to(torch.uint8)  # a radix pass
            hist, rank = _scan(keys, tidx[lo : lo + changes] - start, nctx)
            hists.append(hist)
            rank_parts.append(rank)
        used.append((start, count, lo, lo + changes))
        lo += changes
    old_at = ob[tidx]
    device_parts = {
        "index": tidx,
        "value": nb[tidx],
        "old": old_at,
        "ctx": ((old_at >> shift) & emask).to(torch.int16),  # each change's old exponent
    }
    if ranks:
        device_parts["hist"] = (
            torch.cat(hists) if hists else torch.zeros(0, dtype=torch.int64, device=ob.device)
        )
        device_parts["rank"] = (
            torch.cat(rank_parts)
            if rank_parts
            else torch.zeros(0, dtype=torch.int32, device=ob.device)
        )
    if ob.device.type != "cuda":
        return PendingScan(device_parts, used, nctx, None)
    # non-blocking copies to the host land in pinned memory: the staging buffer's, else torch's
    # caching host allocator's
    host = {}
    for name, t in device_parts.items():
        dst = staging.take(t.numel(), t.dtype) if staging is not None else None
        if dst is None:
            host[name] = t.to("cpu", non_blocking=True)
        else:
            host[name] = dst.view(t.shape)
            host[name].copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(ob.device))
    return PendingScan(host, used, nctx, ready)


def _scan(
    keys: torch.Tensor, changed: torch.Tensor, nctx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hist, rank)`` of one chunk on its device, without a synchronization: ``keys`` (uint8,
    the context of every element), ``changed`` (increasing chunk-local indices); ``rank``
    (int32) follows ``changed``'s order."""
    sorted_keys, perm = torch.sort(keys, stable=True)
    # where each context starts in sorted order = the elements of smaller contexts (no
    # bincount: on CUDA it reads the maximum back to the host)
    bounds = torch.searchsorted(
        sorted_keys, torch.arange(nctx, dtype=torch.uint8, device=keys.device)
    )
    end = torch.full((1,), keys.numel(), dtype=bounds.dtype, device=keys.device)
    hist = torch.diff(bounds, append=end)
    mark = torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
    mark[changed] = True
    pos = _nonzero(mark[perm], changed.numel())  # sorted positions of the changes
    rank = pos - bounds[sorted_keys[pos].to(torch.int64)]
    # (context, index) order -> index order: where each one's index sits among ``changed``
    out = torch.empty_like(rank)
    out[torch.searchsorted(changed, perm[pos])] = rank
    return hist, out.to(torch.int32)


def _nonzero(mask: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (int64) of the ``k`` true elements of the flat ``mask``, without a
    synchronization where torch can (``nonzero_static``)."""
    try:
        return torch.nonzero_static(mask, size=k).view(-1)
    except (NotImplementedError, RuntimeError):  # pragma: no cover - builds without it
        return torch.nonzero(mask).view(-1)


def warm_up() -> None:
    """Compile the numba kernels that encoding from scans runs, both ways of coding positions (their first call in a process
    compiles them: seconds, more than a whole 7B delta's encode) on two tiny deltas, one sparse
    and one dense: the sharded publisher calls this in its pool when it starts, so the first
    delta after the anchor does not pay for it."""
    from deltarl.weightsync.codec.compact import encode_compact, warm_up_states
    from deltarl.weightsync.delta import compute_delta

    old, new = warm_up_states()
    delta = compute_delta(old, new, 0, 1)
    scans: dict[tuple[str, int], ChunkScan] = {}
    for k in old:
        _, _, found = changes_and_scans(old[k], new[k])
        scans.update(((k, s), sc) for s, sc in found.items())
    for threads in (1, 2):
        for positions in POSITIONS:
            encode_compact(delta, None, threads=threads, scans=scans, positions=positions)
