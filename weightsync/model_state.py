"""Which tensors of a model are published, and in which precision.

Shared by the trainer (what it publishes) and the rollout engines (what they hold under the same
names), so that both sides list the same tensors with the same dtypes:

* :func:`publishable_state`: the floating-point entries of ``model.state_dict()``, tied weights
  once. Persistent float buffers count: DeepSeek-V3's router bias
  (``mlp.gate.e_score_correction_bias``) is a buffer, and a replica must hold it too.
* :func:`fp32_names`: the tensors a Hugging Face model keeps in float32 when it is loaded in
  bf16 or fp16 (``_keep_in_fp32_modules_strict``, and ``_keep_in_fp32_modules`` for fp16), as
  transformers itself decides when it loads or builds the model in that dtype: DeepSeek-V3's
  router (``mlp.gate.weight`` and its bias); Qwen3-MoE declares none (its router is bf16). A
  publisher casts these to float32 instead of the publish dtype, so that a replica built by
  transformers in bf16 holds exactly the published dtypes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

import torch

__all__ = ["fp32_names", "publish_dtype", "publishable_state"]


def publishable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The floating-point entries of ``model.state_dict()``: the weights replicas load.

    Integer or boolean buffers (position ids, masks) are constants of the architecture, not
    weights, and the delta codec handles floating-point tensors only. Tied weights (e.g. an LM
    head sharing the embedding) are published once, under their first name, as
    ``named_parameters()`` lists them: shipping the same tensor twice would double its bytes.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if not t.is_floating_point():
            continue
        # a DTensor (FSDP2) or a meta tensor has no storage (data_ptr 0): tied ones are one
        # object
        ptr = -id(t) if hasattr(t, "to_local") or t.is_meta else t.data_ptr()
        key = (ptr, tuple(t.shape), tuple(t.stride()))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach()
    return out


def _patterns(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """The ``keep in fp32`` module patterns of ``model`` (and of its submodules) at ``dtype``."""
    keep: set[str] = set()
    for module in model.modules():
        if dtype in (torch.float16, torch.bfloat16):
            keep.update(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        if dtype == torch.float16:
            keep.update(getattr(module, "_keep_in_fp32_modules", None) or ())
    return sorted(keep)


def fp32_names(
    model: torch.nn.Module, dtype: torch.dtype, names: Iterable[str] | None = None
) -> frozenset[str]:
    """The tensors of ``names`` (default: :func:`publishable_state`'s) that transformers keeps
    in float32 when ``model`` is loaded in ``dtype``: a name matches a pattern as in
    transformers' loader (a regular-expression search, ``*`` for any characters). Empty for
    models that declare nothing (and for ``dtype`` float32)."""
    patterns = _patterns(model, dtype)
    if not patterns:
        return frozenset()
    regex = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns))
    pool = publishable_state(model) if names is None else names
    return frozenset(n for n in pool if regex.search(n))


def publish_dtype(name: str, dtype: torch.dtype, keep_fp32: AbstractSet[str]) -> torch.dtype:
    """The dtype tensor ``name`` (or a slice key ``name[lo:hi]`` of it) is published in:
    float32 if its name is one of ``keep_fp32`` (:func:`fp32_names`), else ``dtype``."""
    if not keep_fp32:
        return dtype
    base = name
    if name.endswith("]") and "[" in name:
        base = name[: name.rindex("[")]
    return torch.float32 if base in keep_fp32 else dtype
