"""Row views for sharded versions (FSDP2 trainers): the worker's side of slice keys.

A sharded version names its tensors by slice keys ``"name[lo:hi]"`` (rows ``lo..hi-1`` of
``name``, :func:`~.manifest.slice_key`); its parts are ordinary codec objects over those row
ranges. A worker holds whole tensors; :func:`layout_view` gives it the row views (contiguous
views of C-ordered tensors, so scatters and copies into them land in the whole tensor) under
which the usual decode, apply and verify code reads a sharded version. Torch only, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from deltarl.weightsync.delta import Delta
from deltarl.weightsync.errors import CorruptDeltaError, StateMismatchError
from deltarl.weightsync.manifest import parse_slice_key


def layout_view(
    state: Mapping[str, torch.Tensor], layout: tuple[str, ...] | None
) -> Mapping[str, torch.Tensor]:
    """``state`` seen through ``layout`` (None: ``state`` itself). The row ranges must tile
    every tensor of ``state`` exactly (StateMismatchError otherwise). A state already keyed by
    the layout's slice keys (a host mirror loaded from a sharded anchor) is returned as is."""
    if layout is None or all(k in state for k in layout):
        return state if layout is None else {k: state[k] for k in layout}
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, list[tuple[int, int]]] = {}
    for key in layout:
        name, lo, hi = parse_slice_key(key)
        t = state.get(name)
        if t is None or t.dim() == 0 or hi > t.shape[0]:
            raise StateMismatchError(f"the sharded layout names {key}, which this state lacks")
        if not t.is_contiguous():
            raise StateMismatchError(f"{name} is not contiguous: its row views would not be")
        out[key] = t[lo:hi]
        covered.setdefault(name, []).append((lo, hi))
    for name, t in state.items():
        ranges = sorted(covered.get(name, []))
        ends = [0, *[hi for _, hi in ranges]]
        if not ranges or [lo for lo, _ in ranges] != ends[:-1] or ends[-1] != t.shape[0]:
            raise StateMismatchError(
                f"the sharded layout does not cover the rows of {name} exactly: {ranges}"
            )
    return out


def merge_parts(parts: Iterable[Delta], layout: tuple[str, ...]) -> Delta:
    """One delta from the decoded parts of a sharded delta; CorruptDeltaError unless they
    agree on the versions and cover ``layout`` exactly once."""
    merged: Delta | None = None
    for d in parts:
        if merged is None:
            merged = Delta(d.base_version, d.version, {})
        elif (d.base_version, d.version) != (merged.base_version, merged.version):
            raise CorruptDeltaError("the parts of a sharded delta disagree on their versions")
        overlap = set(d.patches) & set(merged.patches)
        if overlap:
            raise CorruptDeltaError(f"parts of a sharded delta overlap: {sorted(overlap)[:3]}")
        merged.patches.update(d.patches)
    if merged is None or set(merged.patches) != set(layout):
        raise CorruptDeltaError("the parts of a sharded delta do not cover its layout")
    return merged
