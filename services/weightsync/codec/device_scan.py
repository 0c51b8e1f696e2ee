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

Works on any torch device (the tests run it on CPU against the numba kernel).
"""

from __future__ import annotations

import numpy as np
import torch

from deltarl.services.weightsync.codec.bits import bits_view, float_format
from deltarl.services.weightsync.codec.compact import DEFAULT_CHUNK_ELEMS
from deltarl.services.weightsync.codec.compact_chunks import ChunkScan, context_layout

__all__ = ["changes_and_scans"]


def changes_and_scans(
    old: torch.Tensor, new: torch.Tensor, chunk_elems: int = DEFAULT_CHUNK_ELEMS
) -> tuple[np.ndarray, np.ndarray, dict[int, ChunkScan]]:
    """``(index, value, scans)``: the flat indices (int64) and new bit patterns of the elements
    whose bits differ (as :func:`~deltarl.services.weightsync.delta.changed_elements`), and the
    :class:`ChunkScan` of every chunk of ``chunk_elems`` elements with a change, by chunk start.

    ``old`` and ``new``: same dtype, shape and device. Transient device memory: about 16 bytes
    per element of one chunk (the contexts, the sort's keys and permutation, a mark per element).
    Three synchronizations per tensor (the count of changes, the chunks' bounds, the copy to the
    host) and one copy: everything for the host is packed into one buffer (pinned on a GPU).
    """
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
    ob, nb = bits_view(old.contiguous()), bits_view(new.contiguous())
    n = ob.numel()
    tidx = torch.nonzero(ob != nb).view(-1)  # sync: the number of changes
    k = tidx.numel()
    if k == 0:
        return np.empty(0, np.int64), np.empty(0, fmt.bits_dtype), {}
    edges = torch.arange(0, n + chunk_elems, chunk_elems, device=ob.device).clamp_(max=n)
    bounds = torch.searchsorted(tidx, edges).tolist()  # sync: where each chunk's changes are
    hists: list[torch.Tensor] = []
    ranks: list[torch.Tensor] = []
    used: list[tuple[int, int, int, int]] = []  # (start, count, lo, hi)
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        if hi == lo:
            continue
        start = i * chunk_elems
        count = min(chunk_elems, n - start)
        keys = ((ob[start : start + count] >> shift) & emask).to(torch.uint8)  # one radix pass
        hist, rank = _scan(keys, tidx[lo:hi] - start, emask + 1)
        hists.append(hist)
        ranks.append(rank)
        used.append((start, count, lo, hi))
    old_at = ob[tidx]
    ctx = ((old_at >> shift) & emask).to(torch.uint8)  # each change's context: its old exponent
    # widest items first, so every part of the packed buffer stays aligned for its dtype
    host = _to_host([tidx, torch.stack(hists), torch.cat(ranks), nb[tidx], old_at, ctx])
    index, hist_h, rank_h, value, old_h, ctx_h = host
    scans: dict[int, ChunkScan] = {}
    for j, (start, count, lo, hi) in enumerate(used):
        scans[start] = ChunkScan(
            count=count,
            hist=hist_h[j * (emask + 1) : (j + 1) * (emask + 1)],
            ctx=ctx_h[lo:hi],
            rank=rank_h[lo:hi],
            old=old_h[lo:hi],
        )
    return index, value, scans


def _scan(
    keys: torch.Tensor, changed: torch.Tensor, nctx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hist, rank)`` of one chunk on its device: ``keys`` (uint8, the context of every
    element), ``changed`` (increasing chunk-local indices, ``k`` of them); ``rank`` (int32)
    follows ``changed``'s order. No synchronization."""
    k = changed.numel()
    hist = torch.bincount(keys, minlength=nctx)
    first = torch.cumsum(hist, 0) - hist  # elements of smaller contexts
    sorted_keys, perm = torch.sort(keys, stable=True)
    mark = torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
    mark[changed] = True
    pos = _nonzero(mark[perm], k)  # sorted positions of the changes
    rank = pos - first[sorted_keys[pos].to(torch.int64)]
    # (context, index) order -> index order: where each one's index sits among ``changed``
    out = torch.empty_like(rank)
    out[torch.searchsorted(changed, perm[pos])] = rank
    return hist, out.to(torch.int32)


def _nonzero(mask: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` true elements of ``mask``, without a synchronization where the
    device supports it (``nonzero_static``)."""
    try:
        return torch.nonzero_static(mask, size=k).view(-1)
    except (NotImplementedError, RuntimeError):  # pragma: no cover - older builds or devices
        return torch.nonzero(mask).view(-1)


def _to_host(parts: list[torch.Tensor]) -> list[np.ndarray]:
    """The tensors as numpy arrays on the host, in one copy: packed into one byte buffer on their
    device, copied into pinned memory (from a GPU) and split there without another copy."""
    flat = [t.contiguous().view(-1) for t in parts]
    if flat[0].device.type == "cpu":
        return [t.numpy() for t in flat]
    sizes = [t.numel() * t.element_size() for t in flat]
    packed = torch.cat([t.view(torch.uint8) for t in flat])
    host = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    torch.cuda.current_stream(packed.device).synchronize()
    buf = host.numpy()
    out, at = [], 0
    for t, size in zip(flat, sizes, strict=True):
        np_dtype = torch.empty(0, dtype=t.dtype).numpy().dtype
        out.append(buf[at : at + size].view(np_dtype))
        at += size
    return out
