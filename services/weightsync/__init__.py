"""Lossless sparse weight sync: compute, encode, publish and apply bf16 deltas bit-exactly.

Public surface (import from here):

* :class:`Delta`, :class:`TensorPatch`, :func:`compute_delta`, :func:`apply_delta`, :func:`compose`
* digests: :func:`tensor_digest`, :func:`state_digest`
* errors: :class:`DeltaError` and its subclasses
"""

from .delta import Delta, TensorPatch, apply_delta, compose, compute_delta, verify_base
from .digest import combine_digests, state_digest, state_digests, tensor_digest
from .errors import (
    BaseMismatchError,
    CorruptDeltaError,
    DeltaError,
    StateMismatchError,
    VerificationError,
)

__all__ = [
    "BaseMismatchError",
    "CorruptDeltaError",
    "Delta",
    "DeltaError",
    "StateMismatchError",
    "TensorPatch",
    "VerificationError",
    "apply_delta",
    "combine_digests",
    "compose",
    "compute_delta",
    "state_digest",
    "state_digests",
    "tensor_digest",
    "verify_base",
]
