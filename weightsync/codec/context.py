"""Context for *chained* compact deltas: what a receiver keeps of the last delta it applied.

Between consecutive optimizer steps an element that moved tends to move again, in the same
direction and by a similar amount (Adam's momentum). A chained delta ``v -> v+1`` is coded
against the delta ``u -> v`` the receiver applied just before: for every element that changed
in ``u -> v`` it knows the bit pattern *before* (at ``u``) and after (at ``v``, its current
weights), so both sides can predict the next value by extrapolating that move, and code the
difference from the prediction instead of from the old value (docs/weightsync.md, "Chained
deltas").

:class:`DeltaContext` is that knowledge: per tensor, the sorted flat indices of the elements the
delta changed and their bit patterns before it. It costs ~10 bytes per changed element (8 for
the index, 2 for a bf16 pattern) and is identified by the two versions and a digest, which a
chained delta records so that a receiver holding any other context is refused before anything
is decoded (:class:`ContextMismatchError`).

Prediction (:func:`predict`) decodes the patterns to exact float64 values, extrapolates with
IEEE-754 float64 operations on exactly representable values (deterministic; no fused
multiply-add), and rounds to the tensor's format with integer arithmetic. Only normal, finite
inputs and results are predicted; anything else (zeros, subnormals, infinities, NaNs,
overflow) falls back to "no prediction", so a flush-to-zero floating-point mode or a
platform's NaN payloads can never make the encoder and the decoder disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from deltarl.weightsync.codec import kernels
from deltarl.weightsync.codec.bits import FloatFormat, bits_view, float_format
from deltarl.weightsync.delta import Delta
from deltarl.weightsync.errors import ContextMismatchError

__all__ = [
    "N_MOVE_BUCKETS",
    "RHO16_DEFAULT",
    "ContextMismatchError",
    "DeltaContext",
    "context_digest",
    "predict",
]

RHO16_DEFAULT = 14
"""Default extrapolation factor, in sixteenths: the next move is predicted as 14/16 = 0.875 of
the previous one (close to Adam's beta1 = 0.9; measured flat between 0.8 and 1.0)."""

N_MOVE_BUCKETS = 15
"""Value contexts per old exponent in a chained delta: 0 = the element did not move in the
context delta; otherwise the sign and bit length (1, 2, 3, 4, 5, 6, >= 7) of its previous move
in bit-pattern units."""


@dataclass(frozen=True, slots=True)
class DeltaContext:
    """The elements one delta changed, with their bit patterns before it.

    Build it with :meth:`of` from the delta and the state it is about to be applied to (before
    applying). Example::

        ctx = DeltaContext.of(delta_41_42, state_at_41)
        apply_delta(state_at_41, delta_41_42)          # state is now at 42
        chained = encode_compact(delta_42_43, state_at_42, context=ctx)
        decode_compact(chained, state_at_42, context=ctx)
    """

    base_version: int | None
    version: int | None
    index: Mapping[str, np.ndarray]  # int64, strictly increasing flat indices
    before: Mapping[str, np.ndarray]  # bit patterns at base_version (int16/int32)
    dtypes: Mapping[str, str]
    digest: str = field(default="")

    @classmethod
    def of(cls, delta: Delta, base: Mapping[str, torch.Tensor]) -> DeltaContext:
        """Context of ``delta`` from ``base``, the state it applies to (CPU or GPU tensors; read
        only the changed elements)."""
        index: dict[str, np.ndarray] = {}
        before: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        for name, p in delta.patches.items():
            if not p.changed:
                continue
            t = base[name]
            fmt = float_format(t.dtype)
            flat = bits_view(t.detach().contiguous())
            idx = torch.from_numpy(p.index)
            if flat.device.type != "cpu":
                idx = idx.to(flat.device)
            vals = flat.index_select(0, idx).cpu().numpy()
            index[name] = np.ascontiguousarray(p.index, dtype=np.int64)
            before[name] = vals.astype(fmt.bits_dtype, copy=False)
            dtypes[name] = fmt.name
        return cls.build(delta.base_version, delta.version, index, before, dtypes)

    @classmethod
    def build(
        cls,
        base_version: int | None,
        version: int | None,
        index: Mapping[str, np.ndarray],
        before: Mapping[str, np.ndarray],
        dtypes: Mapping[str, str],
    ) -> DeltaContext:
        return cls(
            base_version,
            version,
            dict(index),
            dict(before),
            dict(dtypes),
            context_digest(index, before, dtypes),
        )

    @property
    def changed(self) -> int:
        return sum(int(i.size) for i in self.index.values())

    @property
    def nbytes(self) -> int:
        return sum(int(i.nbytes) for i in self.index.values()) + sum(
            int(b.nbytes) for b in self.before.values()
        )

    def chunk(self, name: str, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk-local indices and before-patterns of ``name`` within ``[start, start+count)``."""
        idx = self.index.get(name)
        if idx is None:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        lo, hi = np.searchsorted(idx, [start, start + count])
        return idx[lo:hi] - start, self.before[name][lo:hi]

    def describe(self) -> dict[str, object]:
        """What a chained delta's footer records of its context."""
        return {
            "base_version": self.base_version,
            "version": self.version,
            "digest": self.digest,
        }


def context_digest(
    index: Mapping[str, np.ndarray], before: Mapping[str, np.ndarray], dtypes: Mapping[str, str]
) -> str:
    """xxh3-128 over the sorted names, dtypes, indices and before-patterns."""
    h = xxhash.xxh3_128()
    for name in sorted(index):
        idx = np.ascontiguousarray(index[name], dtype="<i8")
        fmt = float_format(dtypes[name])
        b = np.ascontiguousarray(before[name], dtype=fmt.bits_dtype.newbyteorder("<"))
        h.update(f"{name}\0{fmt.name}\0{idx.size}\n".encode())
        h.update(idx.data)
        h.update(b.data)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# prediction


def predict(
    old: np.ndarray,
    index: np.ndarray,
    prev_index: np.ndarray,
    prev_before: np.ndarray,
    fmt: FloatFormat,
    rho16: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Predicted bit patterns, forbidden residuals and move buckets of the elements ``index``
    of a chunk (one compiled pass: ``kernels.predict_moves``).

    ``old``: the chunk's current bit patterns; ``index``: chunk-local indices of the elements
    to predict; ``prev_index``/``prev_before``: the context's chunk-local indices (sorted) and
    bit patterns before its delta. An element the context moved, with both patterns normal
    numbers, is predicted as ``o + (o - b) * rho16 / 16`` computed exactly in float64 and
    rounded to nearest even in the format (no prediction if that is zero, subnormal or
    overflows); any other element is predicted to stay (prediction = old, bucket 0 if it did
    not move). ``forbidden = old - prediction`` (wrapped): the residual a changed element can
    never have.
    """
    k = index.size
    pred = np.empty(k, fmt.bits_dtype)
    forbidden = np.empty(k, np.int64)
    buckets = np.empty(k, np.int64)
    kernels.predict_moves(
        old,
        np.ascontiguousarray(index, dtype=np.int64),
        np.ascontiguousarray(prev_index, dtype=np.int64),
        np.ascontiguousarray(prev_before),
        fmt.width,
        fmt.mantissa_bits,
        fmt.exponent_bits,
        rho16,
        pred,
        forbidden,
        buckets,
    )
    return pred, forbidden, buckets


def skip_forbidden(d: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Map a residual ``d`` that can never equal ``f`` (the residual of "unchanged") onto the
    non-zero integers, bijectively: a changed element's residual from its prediction may be 0,
    and the symbol alphabet has no 0."""
    return d - ((f < d) & (d <= 0)) + ((d >= 0) & (d < f))
