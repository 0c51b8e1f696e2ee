"""Host memory that a delta's changes are decoded straight into, laid out the way
:func:`~deltarl.weightsync.delta.stage_delta` copies them to a GPU.

A rollout worker decodes a delta on the host and copies its changes to the GPU: hundreds of
millions of indices and values for a large mixture-of-experts model. Decoded into arrays of
their own, they were first written to freshly allocated memory (a page fault per 4 KiB), then
gathered into one pinned buffer per bit width for the copy (every byte read and written once
more). :func:`change_arrays` hands the decoder its output arrays as views into pinned buffers
instead: all the indices in one, the values in one per bit width, each in the order
``stage_delta`` sends them (by bit width, first seen first, then in patch order). Staging then
finds the arrays back to back in one of these buffers (:func:`host_view`) and copies the buffer
itself, with nothing gathered.

The buffers come from torch's pinned-memory cache, so a new version's usually reuses the last
one's pages; each array keeps its buffer alive, and a buffer returns to the cache only once no
array is left that views it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

TORCH_OF_NUMPY: dict[np.dtype, torch.dtype] = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int16): torch.int16,
}

# every buffer handed out, by its first byte's address (weak: an entry goes with its buffer)
_buffers: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def change_arrays(
    sizes: Sequence[tuple[int, np.dtype]], *, pin: bool = True
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(indices, values)`` arrays of ``sizes[i] = (changes, value dtype)`` for the patches
    of a delta in order: int64 indices and values of that dtype, views into one index buffer
    and one value buffer per dtype (pinned unless ``pin`` is false or no pinned memory is to
    be had). Arrays of no changes are empty arrays of their own."""
    dtypes = [np.dtype(d) for _, d in sizes]
    for d in dtypes:
        if d not in TORCH_OF_NUMPY:
            raise ValueError(f"no value buffer for dtype {d}")
    groups: dict[np.dtype, list[int]] = {}
    for i, (n, _) in enumerate(sizes):
        if n < 0:
            raise ValueError(f"a patch of {n} changes")
        if n:
            groups.setdefault(dtypes[i], []).append(i)
    out = [(np.empty(0, np.int64), np.empty(0, d)) for d in dtypes]
    index = _buffer(sum(n for n, _ in sizes), torch.int64, pin)
    at = 0
    for dtype, members in groups.items():
        values = _buffer(sum(sizes[i][0] for i in members), TORCH_OF_NUMPY[dtype], pin)
        v = 0
        for i in members:
            n = sizes[i][0]
            out[i] = (index[at : at + n], values[v : v + n])
            at += n
            v += n
    return out


def _buffer(n: int, dtype: torch.dtype, pin: bool) -> np.ndarray:
    """A numpy view of a new (pinned) buffer, registered by the tensor that the view holds."""
    t = None
    if pin and n:
        try:
            t = torch.empty(n, dtype=dtype, pin_memory=True)
        except RuntimeError as err:  # no pinned memory (or no CUDA): correct, slower copies
            logger.warning("pinned buffer for decoded changes unavailable (%s); pageable", err)
    if t is None:
        t = torch.empty(n, dtype=dtype)
    array = t.numpy()
    holder = array.base  # the tensor that keeps the memory alive as long as any view of it
    if n and isinstance(holder, torch.Tensor):
        with _lock:
            _buffers[holder.data_ptr()] = holder
    return array


def _owner(addr: int) -> tuple[int, torch.Tensor] | None:
    """The buffer that holds byte ``addr`` and its first byte's address, if any."""
    with _lock:
        owners = list(_buffers.items())
    for lo, t in owners:
        if lo <= addr < lo + t.numel() * t.element_size():
            return lo, t
    return None


def host_runs(arrays: Sequence[np.ndarray]) -> list[tuple[int, torch.Tensor | None]]:
    """``arrays`` (non-empty) cut into runs, each ``(arrays in it, view)``: the view of the one
    :func:`change_arrays` buffer that holds the run's arrays back to back, in order, in its
    dtype; or None for a run of arrays that lie in no such buffer (the caller gathers them)."""
    runs: list[tuple[int, torch.Tensor | None]] = []
    i = 0
    while i < len(arrays):
        first = arrays[i]
        found = _owner(first.ctypes.data) if first.flags.c_contiguous else None
        if found is None or TORCH_OF_NUMPY.get(first.dtype) != found[1].dtype:
            j = i + 1
            while j < len(arrays) and _loose(arrays[j]):
                j += 1
            runs.append((j - i, None))
            i = j
            continue
        lo, t = found
        hi = lo + t.numel() * t.element_size()
        end, j = first.ctypes.data + first.nbytes, i + 1
        while j < len(arrays):
            a = arrays[j]
            if (
                a.ctypes.data != end
                or end + a.nbytes > hi  # a neighbouring buffer's
                or a.dtype != first.dtype
                or not a.flags.c_contiguous
            ):
                break
            end += a.nbytes
            j += 1
        size = t.element_size()
        runs.append((j - i, t[(first.ctypes.data - lo) // size : (end - lo) // size]))
        i = j
    return runs


def _loose(a: np.ndarray) -> bool:
    """Whether ``a`` lies in no buffer of its dtype."""
    found = _owner(a.ctypes.data) if a.flags.c_contiguous else None
    return found is None or TORCH_OF_NUMPY.get(a.dtype) != found[1].dtype
