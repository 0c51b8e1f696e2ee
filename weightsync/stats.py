"""How big a delta is, and how big it could be: density and entropy floors.

Two floors are reported in bits per changed element (shared/REFERENCE.md section 3):

* ``iid_floor_bits``: positions as if every element changed independently with the same
  probability p (``H(p)/p``), plus the empirical entropy of the value differences (new minus old
  bit pattern). This is what a codec that ignores the old weights can hope for.
* ``conditional_floor_bits``: the empirical entropy of the change mask and of the value
  differences *given the tensor and the old value's exponent*, i.e. with the receiver's weights as
  side information. The compact format aims to come within a few percent of it (the statistics a
  real coder must transmit are not counted here, so it is a slightly optimistic floor).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
import torch

from deltarl.weightsync.codec.bits import bits_numpy, float_format
from deltarl.weightsync.codec.entropy import wrapped_diff
from deltarl.weightsync.delta import Delta


def binary_entropy(p: np.ndarray | float) -> np.ndarray:
    p = np.clip(np.asarray(p, np.float64), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
    return np.nan_to_num(h)


def empirical_entropy_bits(values: np.ndarray) -> float:
    """Total bits of ``values`` under their own empirical distribution (n * H)."""
    if values.size == 0:
        return 0.0
    _, counts = np.unique(values, return_counts=True)
    p = counts / values.size
    return float(-(counts * np.log2(p)).sum())


@dataclass(slots=True)
class DeltaStats:
    numel: int
    changed: int
    density: float
    dense_bytes: int
    iid_floor_bits: float  # bits per changed element
    conditional_floor_bits: float  # bits per changed element
    mask_conditional_bits: float  # the position part of conditional_floor_bits
    value_conditional_bits: float  # the value part of conditional_floor_bits

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def delta_stats(delta: Delta, base: Mapping[str, torch.Tensor]) -> DeltaStats:
    """Density and entropy floors of ``delta`` (``base`` = the state it applies to, CPU)."""
    numel = delta.numel
    changed = delta.changed
    all_diffs: list[np.ndarray] = []
    mask_bits = 0.0
    value_bits = 0.0
    for name, p in delta.patches.items():
        if not p.changed:
            continue
        fmt = float_format(p.dtype)
        old = bits_numpy(base[name].contiguous())
        exp_all = (old.astype(np.int64) >> fmt.mantissa_bits) & fmt.exponent_mask
        n_e = np.bincount(exp_all, minlength=fmt.exponent_mask + 1)
        exp_changed = exp_all[p.index]
        k_e = np.bincount(exp_changed, minlength=fmt.exponent_mask + 1)
        nz = n_e > 0
        mask_bits += float((n_e[nz] * binary_entropy(k_e[nz] / n_e[nz])).sum())
        d = wrapped_diff(p.value, old[p.index], fmt.width)
        all_diffs.append(d)
        order = np.argsort(exp_changed, kind="stable")
        es, ds = exp_changed[order], d[order]
        bounds = np.flatnonzero(np.diff(es)) + 1
        for seg in np.split(ds, bounds):
            value_bits += empirical_entropy_bits(seg)
    if changed:
        p_all = changed / numel
        iid = (
            float(binary_entropy(p_all)) / p_all
            + empirical_entropy_bits(np.concatenate(all_diffs)) / changed
        )
        cond_mask = mask_bits / changed
        cond_value = value_bits / changed
    else:
        iid = cond_mask = cond_value = 0.0
    return DeltaStats(
        numel=numel,
        changed=changed,
        density=changed / numel if numel else 0.0,
        dense_bytes=delta.dense_bytes,
        iid_floor_bits=iid,
        conditional_floor_bits=cond_mask + cond_value,
        mask_conditional_bits=cond_mask,
        value_conditional_bits=cond_value,
    )
