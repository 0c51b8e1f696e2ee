"""Lossless sparse weight sync: compute, encode, publish and apply bf16 deltas bit-exactly.

Public surface (import from here; submodules load lazily so that torch-free parts such as the
manifest and the planner can be imported without torch):

* :class:`Delta`, :class:`TensorPatch`, :func:`compute_delta`, :func:`apply_delta`, :func:`compose`
* :class:`DeltaContext`: what a receiver keeps of its last delta to decode chained deltas
* digests: :func:`tensor_digest`, :func:`state_digest`
* errors: :class:`DeltaError` and its subclasses
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Delta": "delta",
    "TensorPatch": "delta",
    "apply_delta": "delta",
    "compose": "delta",
    "compute_delta": "delta",
    "verify_base": "delta",
    "verify_result": "delta",
    "StagedDelta": "delta",
    "stage_delta": "delta",
    "apply_staged": "delta",
    "DeltaContext": "codec.context",
    "combine_digests": "digest",
    "state_digest": "digest",
    "state_digests": "digest",
    "tensor_digest": "digest",
    "BaseMismatchError": "errors",
    "ContextMismatchError": "errors",
    "CorruptDeltaError": "errors",
    "DeltaError": "errors",
    "StateMismatchError": "errors",
    "VerificationError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
