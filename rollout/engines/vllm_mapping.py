"""Hugging Face parameter names -> writable views into a vLLM model's (fused) parameters.

vLLM stores several checkpoint tensors in one runtime parameter (``q/k/v_proj`` ->
``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``, row blocks in that order), pads the vocabulary
of embeddings and LM heads, and renames modules per architecture; in vLLM 0.33 its Transformers
backend (``--model-impl transformers``) fuses QKV and GLU projections too, so no model
implementation keeps Hugging Face names. Instead of a table per architecture, :func:`probe_views`
asks the model's own loader where each checkpoint tensor goes: it calls
``model.load_weights([(name, probe)])`` once per name with ``Tensor.copy_`` patched to *record*
the destination instead of writing it. A destination that is a contiguous view of one runtime
parameter, with the checkpoint tensor's dtype and shape, receiving the probe tensor unchanged,
becomes the Hugging Face-named view. Under tensor parallelism (:func:`probe_shards`) the loader
narrows the tensor to the rank's part first: the view then holds that part, whose
:class:`~deltarl.rollout.engines.vllm_shards.Box` is read off the narrowed source. Anything else
(casts, transforms, writes it twice; quantized parameters) is refused with
the reason, since a bit-exact in-place delta needs the checkpoint's bytes to be the runtime
bytes. Nothing is written to the model while probing (``fill_``/``zero_`` on its storage, as the
padded-vocabulary loader does to padding rows, are skipped too).

The views are what :meth:`~deltarl.rollout.engines.base.Engine.named_parameters` returns for the
vLLM engine, so the shared delta code (``stage_delta``/``apply_staged``/``tensor_digest``) patches
and verifies vLLM's GPU tensors in place with Hugging Face names and shapes. No vLLM import here:
the tests build a model with vLLM-like fused parameters and loader.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deltarl.rollout.engines.vllm_shards import Box, box_of
from deltarl.services.weightsync.codec.bits import dtype_name

_PROBE_LOCK = threading.Lock()  # Tensor.copy_ is patched process-wide while probing


class MappingError(ValueError):
    """The model cannot be patched in place under Hugging Face names (the message says why)."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A checkpoint tensor: ``TensorSpec("model.norm.weight", "bfloat16", (576,))``."""

    name: str
    dtype: str  # "bfloat16" | "float16" | "float32"
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TensorSpec:
        return cls(str(obj["name"]), str(obj["dtype"]), tuple(int(d) for d in obj["shape"]))


def specs_of(state: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The specs of a state dict (e.g. a Hugging Face model's parameters on the meta device)."""
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()]


@dataclass(slots=True)
class _Records:
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source) of probe copies
    foreign: int = 0  # writes into the model from anything but the probe (skipped)


@contextlib.contextmanager
def _recording(probe: torch.Tensor, owned: set[int], records: _Records) -> Iterator[None]:
    """Patch ``Tensor.copy_`` (and ``fill_``/``zero_``) so that nothing reaches the model."""
    copy, fill, zero = torch.Tensor.copy_, torch.Tensor.fill_, torch.Tensor.zero_
    probe_ptr = probe.untyped_storage().data_ptr()

    def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if isinstance(src, torch.Tensor) and src.untyped_storage().data_ptr() == probe_ptr:
            records.copies.append((dst, src))
            return dst
        if dst.untyped_storage().data_ptr() in owned:
            records.foreign += 1
            return dst
        return copy(dst, src, non_blocking)

    def fill_(t: torch.Tensor, value: Any) -> torch.Tensor:
        return t if t.untyped_storage().data_ptr() in owned else fill(t, value)

    def zero_(t: torch.Tensor) -> torch.Tensor:
        return t if t.untyped_storage().data_ptr() in owned else zero(t)

    torch.Tensor.copy_ = copy_  # type: ignore[method-assign,assignment]
    torch.Tensor.fill_ = fill_  # type: ignore[method-assign,assignment]
    torch.Tensor.zero_ = zero_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.copy_ = copy  # type: ignore[method-assign]
        torch.Tensor.fill_ = fill  # type: ignore[method-assign]
        torch.Tensor.zero_ = zero  # type: ignore[method-assign]


def _view_for(
    spec: TensorSpec, records: _Records, probe: torch.Tensor, shards: bool = False
) -> tuple[torch.Tensor, Box]:
    if records.foreign:
        raise MappingError(
            f"{spec.name}: the model's loader stores a transformed copy of it (a cast, scale, "
            "permutation or concatenation), not its bytes: it cannot be patched in place"
        )
    if not records.copies:
        raise MappingError(
            f"{spec.name}: the model's loader stored it nowhere (an unknown name, a weight the "
            "model ties to another one and skips, or a loader that does not use Tensor.copy_)"
        )
    if len(records.copies) > 1:
        raise MappingError(f"{spec.name}: the loader writes it {len(records.copies)} times")
    dst, src = records.copies[0]
    box = box_of(src, probe)
    if box is None or (not box.is_full and not shards):
        what = "a transformed part" if box is None else "only part"
        raise MappingError(
            f"{spec.name}: the loader keeps {what} of it ({list(src.shape)} of "
            f"{list(spec.shape)})"
            + ("" if shards else ": tensor or pipeline parallelism needs shards=True")
        )
    if not dst.is_contiguous():
        raise MappingError(f"{spec.name}: the loader transposes or strides it")
    if dtype_name(dst.dtype) != spec.dtype or tuple(dst.shape) != box.size:
        raise MappingError(
            f"{spec.name}: the runtime tensor is {dtype_name(dst.dtype)}{list(dst.shape)}, the "
            f"checkpoint's part {spec.dtype}{list(box.size)} (quantized, or another dtype?)"
        )
    return dst.detach(), box


def probe_views(model: torch.nn.Module, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Hugging Face name -> contiguous writable view of ``model``'s runtime storage.

    ``model`` needs vLLM's ``load_weights(iterable of (name, tensor))``. Raises
    :class:`MappingError` when a tensor is not stored verbatim as one contiguous block (see the
    module docstring) or when two names share bytes.
    """
    views, _ = probe_shards(model, specs, shards=False)
    return views


def probe_shards(
    model: torch.nn.Module, specs: list[TensorSpec], *, shards: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """:func:`probe_views` for one tensor-parallel rank: each name's view holds the
    :class:`~deltarl.rollout.engines.vllm_shards.Box` of the checkpoint tensor that the rank's
    loader narrowed it to (the whole tensor where replicated). ``shards=False`` refuses any
    partial tensor."""
    loader = getattr(model, "load_weights", None)
    if loader is None:
        raise MappingError(f"{type(model).__name__} has no load_weights: not a vLLM model")
    params = dict(model.named_parameters(remove_duplicate=False))
    owned = {p.untyped_storage().data_ptr() for p in params.values()}
    # on the model's device, so that a loader's ``.to(param.device)`` keeps the probe itself
    device = next(iter(params.values())).device if params else torch.device("cpu")
    views: dict[str, torch.Tensor] = {}
    boxes: dict[str, Box] = {}
    with _PROBE_LOCK, torch.no_grad():
        for spec in specs:
            dtype = getattr(torch, spec.dtype)
            probe = torch.empty(spec.shape, dtype=dtype, device=device)
            records = _Records([])
            with _recording(probe, owned, records):
                loader([(spec.name, probe)])
            view, box = _view_for(spec, records, probe, shards)
            if view.untyped_storage().data_ptr() not in owned:
                raise MappingError(f"{spec.name}: stored outside the model's parameters")
            views[spec.name], boxes[spec.name] = view, box
    check_disjoint(views)
    return views, boxes


def check_disjoint(views: Mapping[str, torch.Tensor]) -> None:
    """Refuse views that share bytes (a tied pair listed twice, or a confused loader)."""
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for name, v in views.items():
        start = int(v.storage_offset()) * v.element_size()
        spans.setdefault(v.untyped_storage().data_ptr(), []).append(
            (start, start + v.numel() * v.element_size(), name)
        )
    for blocks in spans.values():
        blocks.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(blocks):
            if start < end:
                raise MappingError(
                    f"{a} and {b} share runtime bytes; list tied weights once (Hugging Face "
                    "named_parameters() does)"
                )


def uncovered(model: torch.nn.Module, views: Mapping[str, torch.Tensor]) -> list[str]:
    """Runtime parameters no view touches (logged: their values never follow the trainer)."""
    touched = {v.untyped_storage().data_ptr() for v in views.values()}
    return sorted(
        n for n, p in model.named_parameters() if p.untyped_storage().data_ptr() not in touched
    )
