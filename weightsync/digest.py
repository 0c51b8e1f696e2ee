"""Digests that prove two sets of weights are bit-identical.

A *tensor digest* is the xxh3-128 of the tensor's raw little-endian bytes in C order, prefixed with
its dtype and shape so that a reshape or a cast can never collide with the original. A *state
digest* combines the tensor digests of a whole state dict in name order. Both are lowercase hex.
xxh3 is not a cryptographic hash: it detects corruption and mistakes (wrong base, partial apply,
truncated download), not an adversary; signed manifests are the answer to untrusted buckets.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash

from deltarl.weightsync.codec.bits import dtype_name


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-128 hex digest of ``t``'s dtype, shape and bytes (GPU tensors are copied to CPU)."""
    h = xxhash.xxh3_128()
    h.update(f"{dtype_name(t.dtype)}{list(t.shape)}".encode())
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous().reshape(-1)
    if data.numel():
        h.update(data.view(torch.uint8).numpy().data)
    return h.hexdigest()


def combine_digests(digests: Mapping[str, str]) -> str:
    """State digest from per-tensor digests (order-independent: names are sorted)."""
    h = xxhash.xxh3_128()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name]}\n".encode())
    return h.hexdigest()


def state_digests(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(t) for name, t in state.items()}


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    return combine_digests(state_digests(state))
