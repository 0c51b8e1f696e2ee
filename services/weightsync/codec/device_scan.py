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
    tidx = torch.nonzero(ob != nb).view(-1)
    index = tidx.cpu().numpy().astype(np.int64, copy=False)
    value = nb[tidx].cpu().numpy()
    starts = np.arange(0, ob.numel(), chunk_elems, dtype=np.int64)
    bounds = np.searchsorted(index, np.append(starts, ob.numel()))
    hists, ctxs, ranks, olds = [], [], [], []
    used: list[tuple[int, int, int, int]] = []  # (start, count, lo, hi)
    for i, start in enumerate(starts.tolist()):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        if hi == lo:
            continue
        count = min(chunk_elems, ob.numel() - start)
        part = ob[start : start + count]
        c = ((part >> shift) & emask).to(torch.uint8)  # one byte: the sort is one radix pass
        local = tidx[lo:hi] - start
        hist, ctx, rank = _scan(c, local, emask + 1)
        hists.append(hist)
        ctxs.append(ctx)
        ranks.append(rank)
        olds.append(part[local])
        used.append((start, count, lo, hi))
    scans: dict[int, ChunkScan] = {}
    if not used:
        return index, value, scans
    # one copy of each kind to the host, split per chunk there (the chunks' changes follow each
    # other in index order, so a chunk's rows are its [lo, hi) of the changed elements)
    hist_h = torch.stack(hists).cpu().numpy()
    ctx_h = torch.cat(ctxs).cpu().numpy()
    rank_h = torch.cat(ranks).cpu().numpy()
    old_h = torch.cat(olds).cpu().numpy()
    for j, (start, count, lo, hi) in enumerate(used):
        scans[start] = ChunkScan(
            count=count, hist=hist_h[j], ctx=ctx_h[lo:hi], rank=rank_h[lo:hi], old=old_h[lo:hi]
        )
    return index, value, scans


def _scan(
    keys: torch.Tensor, changed: torch.Tensor, nctx: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hist, ctx, rank)`` of one chunk on its device: ``keys`` (uint8, the context of every
    element), ``changed`` (increasing chunk-local indices). ``ctx`` and ``rank`` follow
    ``changed``'s order."""
    hist = torch.bincount(keys, minlength=nctx)
    first = torch.cumsum(hist, 0) - hist  # elements of smaller contexts
    sorted_keys, perm = torch.sort(keys, stable=True)
    mark = torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
    mark[changed] = True
    pos = torch.nonzero(mark[perm]).view(-1)  # sorted positions of the changed elements
    ctx = sorted_keys[pos].to(torch.int64)
    rank = pos - first[ctx]
    # (context, index) order -> index order: where each one's index sits among ``changed``
    order = torch.searchsorted(changed, perm[pos])
    out_ctx = torch.empty_like(ctx)
    out_rank = torch.empty_like(rank)
    out_ctx[order] = ctx
    out_rank[order] = rank
    return hist, out_ctx.to(torch.int16), out_rank.to(torch.int32)
