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
(casts, transforms, overlapping writes) is refused with the reason, since a bit-exact in-place
delta needs the checkpoint's bytes to be the runtime bytes.

Mixture of experts: transformers 5 holds a layer's routed experts stacked
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``: each expert's gate rows, then its up rows;
``mlp.experts.down_proj`` ``[E, H, I]``), and so does vLLM 0.33
(``mlp.experts.routed_experts.w13_weight`` / ``w2_weight``, the same layouts), but its fused-MoE
loader writes a stacked checkpoint tensor piece by piece: ``chunk(2, dim=1)`` into gate and up,
``unbind()`` into experts, each piece into its slice of the stacked parameter (narrowed per
tensor-parallel rank; only the rank's own experts under expert parallelism). The probe records
every piece: each source must be a box of the checkpoint tensor (:func:`_aligned` puts back the
dimensions an index dropped), the destinations must tile one contiguous block of one
parameter, and the sources, in the destinations' order, must be one box of the tensor, or of a
refinement of its shape (:func:`_merge_refined`: a tensor-parallel rank's gate rows and up rows
of every expert are one box of ``[E, 2, I, H]``). The view is that block: one tensor per
stacked expert parameter, however many experts, so a delta of every expert of every layer is
one staged apply (one store-kernel launch). Per-expert checkpoint names
(``mlp.experts.{e}.gate_proj.weight``, transformers < 5) map to blocks of the same parameters.
Parameters vLLM derives from checkpoint tensors after loading (:data:`DERIVED_AFTER_LOADING`:
MLA's absorbed ``kv_b_proj``) are refused: an in-place patch would not reach them.

Block fp8 (:mod:`deltarl.weightsync.fp8`): the specs of an fp8 version
(:func:`fp8_specs`: each quantized weight as ``float8_e4m3fn`` plus its ``*_scale_inv``
float32 block scales) are probed the same way, and map where vLLM stores both verbatim: its
CUTLASS block-fp8 path on Hopper (``VLLM_USE_DEEP_GEMM=0``), whose fused ``qkv_proj`` /
``gate_up_proj`` hold each checkpoint weight's rows and each scale's block rows. Where vLLM
requantizes or re-lays the scales at load (DeepGEMM's E8M0 scales in a TMA-aligned layout), a
scale's destination is not a contiguous block of the checkpoint's shape, and it is refused. Nothing is written to the model while probing (``fill_``/``zero_`` on its storage, as the
padded-vocabulary loader does to padding rows, are skipped too).

The views are what :meth:`~deltarl.rollout.engines.base.Engine.named_parameters` returns for the
vLLM engine, so the shared delta code (``stage_delta``/``apply_staged``/``tensor_digest``) patches
and verifies vLLM's GPU tensors in place with Hugging Face names and shapes. No vLLM import here:
the tests build a model with vLLM-like fused parameters and loader.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deltarl.rollout.engines.vllm_shards import Box, box_of
from deltarl.weightsync.codec.bits import dtype_name
from deltarl.weightsync.fp8 import BLOCK, fp8_layout

_PROBE_LOCK = threading.Lock()  # Tensor.copy_ is patched process-wide while probing


# runtime parameters vLLM 0.33 derives from checkpoint tensors after loading them
# (``process_weights_after_loading``): a model holding one cannot be patched in place
DERIVED_AFTER_LOADING = {
    "W_UK_T": "MLA attention's absorbed kv_b_proj",
    "W_UV": "MLA attention's absorbed kv_b_proj",
    "W_K": "MLA attention's quantized kv_b_proj",
    "W_V": "MLA attention's quantized kv_b_proj",
}

# vLLM 0.33's unquantized fused-MoE backends that keep the checkpoint's layout of the stacked
# experts after loading (``convert_to_unquantized_kernel_format`` returns them as they are; the
# FlashInfer ones swap gate and up or re-lay blocks, AITER shuffles, XPU transposes): the
# default on Hopper is Triton
CHECKPOINT_LAYOUT_MOE_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON"})


class MappingError(ValueError):
    """The model cannot be patched in place under Hugging Face names (the message says why)."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A checkpoint tensor: ``TensorSpec("model.norm.weight", "bfloat16", (576,))``."""

    name: str
    dtype: str  # "bfloat16" | "float16" | "float32" | "float8_e4m3fn"
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TensorSpec:
        return cls(str(obj["name"]), str(obj["dtype"]), tuple(int(d) for d in obj["shape"]))


def specs_of(state: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The specs of a state dict (e.g. a Hugging Face model's parameters on the meta device)."""
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()]


def fp8_specs(specs: list[TensorSpec], block: tuple[int, int] = BLOCK) -> list[TensorSpec]:
    """The tensors of the block-fp8 version of a model whose bf16 tensors are ``specs``
    (:func:`~deltarl.weightsync.fp8.fp8_layout`: quantized weights as
    ``float8_e4m3fn``, each followed by its ``*_scale_inv`` float32 scales, one per ``block``),
    i.e. what a trainer with ``publish.fp8`` publishes and what a block-fp8 checkpoint holds."""
    layout = fp8_layout({s.name: (getattr(torch, s.dtype), s.shape) for s in specs}, block)
    return [TensorSpec(n, dtype_name(d), shape) for n, (d, shape) in layout.items()]


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


def _aligned(src: torch.Tensor, probe: torch.Tensor) -> torch.Tensor | None:
    """``src`` (a view of ``probe``) with the dimensions an integer index or ``unbind`` dropped
    put back as size-1 dimensions, so that :func:`box_of` can read its box; None when ``src``
    is not such a view (its strides are not a subsequence of the probe's)."""
    if src.dim() == probe.dim():
        return src
    sizes: list[int] = []
    i = 0
    for j in range(probe.dim()):
        if i < src.dim() and (
            src.shape[i] <= probe.shape[j]
            and (src.shape[i] == 1 or src.stride(i) == probe.stride(j))
        ):
            sizes.append(int(src.shape[i]))
            i += 1
        else:
            sizes.append(1)
    if i != src.dim():
        return None
    return torch.as_strided(src, sizes, probe.stride(), src.storage_offset())


def _join(a: Box, b: Box) -> Box | None:
    """The box whose C-order elements are ``a``'s then ``b``'s, if there is one."""
    for d in range(len(a.shape)):
        if any(a.size[j] != 1 or b.size[j] != 1 or a.start[j] != b.start[j] for j in range(d)):
            return None
        after = range(d + 1, len(a.shape))
        if any(a.start[j] != b.start[j] or a.size[j] != b.size[j] for j in after):
            continue
        if b.start[d] == a.start[d] + a.size[d]:
            size = list(a.size)
            size[d] += b.size[d]
            return Box(a.shape, a.start, tuple(size))
    return None


def _merge(boxes: list[Box]) -> Box | None:
    """One box whose C order is the concatenation of ``boxes`` (shift-reduce: a stack where
    the two top boxes are joined while they can be), or None."""
    stack: list[Box] = []
    for b in boxes:
        stack.append(b)
        while len(stack) > 1 and (j := _join(stack[-2], stack[-1])) is not None:
            stack[-2:] = [j]
    return stack[0] if len(stack) == 1 else None


def _refine(box: Box, d: int, p: int) -> Box | None:
    """``box`` in the shape where dimension ``d`` is split into ``(n // p, p)``, or None when
    the box straddles those blocks."""
    s, k = box.start[d], box.size[d]
    if s // p == (s + k - 1) // p:
        outer, inner = (s // p, 1), (s % p, k)
    elif s % p == 0 and k % p == 0:
        outer, inner = (s // p, k // p), (0, p)
    else:
        return None
    shape = (*box.shape[:d], box.shape[d] // p, p, *box.shape[d + 1 :])
    start = (*box.start[:d], outer[0], inner[0], *box.start[d + 1 :])
    size = (*box.size[:d], outer[1], inner[1], *box.size[d + 1 :])
    return Box(shape, start, size)


def _merge_refined(boxes: list[Box]) -> Box | None:
    """:func:`_merge`, else the same in a refinement of the tensor's shape: one dimension split
    into blocks of ``p`` rows, ``p`` read off the gaps between the pieces' starts (a tensor-
    parallel rank holds rows ``[r*i, (r+1)*i)`` of the gate and of the up half of a stacked
    ``[E, 2I, H]`` expert tensor: one box of ``[E, 2, I, H]``)."""
    merged = _merge(boxes)
    if merged is not None:
        return merged
    shape = boxes[0].shape
    for d, n in enumerate(shape):
        gaps = {abs(a.start[d] - b.start[d]) for a in boxes for b in boxes} - {0}
        for p in sorted((g for g in gaps if n % g == 0 and 1 < g < n), reverse=True):
            refined = [_refine(b, d, p) for b in boxes]
            if all(r is not None for r in refined):
                merged = _merge([r for r in refined if r is not None])
                if merged is not None:
                    return merged
    return None


def _view_for(
    spec: TensorSpec, records: _Records, probe: torch.Tensor, shards: bool = False
) -> tuple[torch.Tensor, Box]:
    """The view and box of one checkpoint tensor from the loader's recorded copies.

    One copy (a plain or fused dense weight) or several (vLLM's fused-MoE loader writes a
    stacked expert tensor expert by expert, and gate and up separately, into slices of
    ``w13_weight``/``w2_weight``): each copy's source must be a box of the probe and its
    destination a contiguous block of the same runtime tensor; together the destinations must
    tile one contiguous block, and the sources, taken in the destinations' order, one box of
    the checkpoint tensor (or of a refinement of its shape, see :func:`_merge_refined`). That
    block, shaped as the box, is the view: one tensor to patch, however many experts."""
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
    pieces: list[tuple[int, Box, torch.Tensor]] = []
    for dst, src in records.copies:
        aligned = _aligned(src, probe)
        box = None if aligned is None else box_of(aligned, probe)
        if box is None:
            raise MappingError(
                f"{spec.name}: the loader keeps a transformed part of it ({list(src.shape)} of "
                f"{list(spec.shape)}, strides {list(src.stride())}: transposed or strided)"
            )
        if not dst.is_contiguous():
            raise MappingError(f"{spec.name}: the loader transposes or strides it")
        if dtype_name(dst.dtype) != spec.dtype or dst.numel() != math.prod(box.size):
            raise MappingError(
                f"{spec.name}: the runtime tensor is {dtype_name(dst.dtype)}{list(dst.shape)}, "
                f"the checkpoint's part {spec.dtype}{list(box.size)} (quantized, or another dtype?)"
            )
        if [d for d in dst.shape if d != 1] != [d for d in box.size if d != 1]:
            raise MappingError(
                f"{spec.name}: the loader reshapes a part of it ({list(box.size)} into "
                f"{list(dst.shape)})"
            )
        pieces.append((int(dst.storage_offset()), box, dst))
    pieces.sort(key=lambda x: x[0])
    first = pieces[0][2]
    if any(
        dst.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        for _, _, dst in pieces
    ):
        raise MappingError(f"{spec.name}: the loader spreads it over several runtime tensors")
    at = pieces[0][0]
    for offset, _, dst in pieces:
        if offset != at:
            raise MappingError(
                f"{spec.name}: the loader writes it {len(pieces)} times, into blocks that "
                "overlap or leave gaps (a replicated expert, or a layout that is not one block)"
            )
        at += dst.numel()
    box = _merge_refined([b for _, b, _ in pieces])
    if box is None:
        raise MappingError(
            f"{spec.name}: the loader writes its {len(pieces)} parts in an order that is not "
            "the C order of one part of it (permuted experts or rows)"
        )
    if box.is_full and box.shape != spec.shape:
        box = Box.full(spec.shape)
    if not box.is_full and not shards:
        raise MappingError(
            f"{spec.name}: the loader keeps only part of it ({list(box.size)} of "
            f"{list(box.shape)}): tensor, expert or pipeline parallelism needs shards=True"
        )
    view = torch.as_strided(first, box.size, _contiguous_strides(box.size), pieces[0][0])
    return view.detach(), box


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


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
    derived = sorted(n for n in params if n.rsplit(".", 1)[-1] in DERIVED_AFTER_LOADING)
    if derived:
        raise MappingError(
            f"{derived[0]} (and {len(derived) - 1} more) is computed from a checkpoint tensor "
            f"after loading ({DERIVED_AFTER_LOADING[derived[0].rsplit('.', 1)[-1]]}): a delta "
            "patched into the checkpoint tensor in place would not reach it"
        )
    for name, module in model.named_modules():
        backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
        value = getattr(backend, "value", backend)
        if backend is not None and value not in CHECKPOINT_LAYOUT_MOE_BACKENDS:
            raise MappingError(
                f"{name}: vLLM's {value} MoE backend re-lays the experts after loading, so "
                "their runtime bytes are not the checkpoint's; vLLM's Triton MoE backend keeps "
                "them (the default on Hopper; moe_backend='triton')"
            )
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
