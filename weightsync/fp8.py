"""Block fp8 weights as vLLM serves them: quantization, the high-precision rule, the layout.

DeepSeek-style block fp8 (checkpoint ``quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}``): a quantized weight ``W``
``[out, in]`` becomes two tensors,

* ``W`` itself in ``float8_e4m3fn`` (same name, same shape, contiguous), and
* ``W + "_scale_inv"`` (``"x.weight"`` -> ``"x.weight_scale_inv"``) in ``float32``
  ``[ceil(out / 128), ceil(in / 128)]``: one scale per 128 x 128 block, such that
  ``W ~ e4m3 * scale`` (DeepSeek's name: the *inverse* of the quantization scale).

That is what vLLM 0.33 holds at run time for such a checkpoint on Hopper with the CUTLASS
block kernels (``VLLM_USE_DEEP_GEMM=0``; docs/vllm.md, "fp8 workers", says which vLLM function
does what). Tensors with leading dimensions (stacked experts ``[E, rows, cols]``) get one block
grid per leading index (scale ``[E, ceil(rows / 128), ceil(cols / 128)]``, vLLM's
``w13_weight_scale_inv`` layout). The same layout in 64 x 64 blocks (``weight_block_size
[64, 64]``, :data:`BLOCK_SIDES`) serves models whose fused projections are not whole 128-row
blocks; vLLM then runs its Triton block kernel, which keeps the bytes as they are too. Every
function here takes the ``block``; 128 x 128 when not given.

Quantization of one block, exactly (:func:`quantize_block_fp8`; a plain reference written
independently is in tests/unit/test_fp8.py):

1. ``x``: the block's values as float32 (bf16 and fp16 convert exactly);
2. ``amax = max |x|`` over the block's elements; an edge block (rows or columns past the
   tensor's end) takes the amax of the elements that exist;
3. ``scale = amax / 448`` as a correctly rounded float32 division, raised to
   :data:`SCALE_FLOOR` (2^-126, the smallest normal float32) when smaller: an all-zero block
   gets scale 2^-126 (its bytes are all zero, its dequantized values 0), and a block of tiny
   values never divides by zero or by a subnormal;
4. every element ``q = e4m3(clamp(fl32(x / scale), -448, 448))``: the correctly rounded float32
   quotient, clamped to e4m3's finite range (a quotient a rounding step above 448), then rounded
   to nearest, ties to even, to ``float8_e4m3fn`` (torch's cast). Signs are kept: ``-0.0`` stays
   ``0x80``.

Non-finite values are refused (``ValueError`` naming the tensor): e4m3fn has no infinity, and a
NaN would poison its whole block's scale.

Which tensors stay in higher precision (:func:`is_quantized`, the one place that decides): every
tensor that is not a floating-point weight of a linear layer, i.e. 0-D and 1-D tensors (norms,
biases, scales), embeddings, the LM head, routers (``mlp.gate``, ``router``,
``shared_expert_gate``) and anything named like a norm; 2-D ``*.weight`` tensors are quantized,
and 3-D tensors only where they are stacked experts (``.experts.`` in the name). A checkpoint
for vLLM lists the kept linear-shaped modules in ``modules_to_not_convert``
(:func:`quantization_config`), because vLLM would otherwise quantize a router.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

BLOCK = (128, 128)
"""Rows x columns of one quantization block (``weight_block_size``): DeepSeek's, the default."""

BLOCK_SIDES = (64, 128)
"""The square blocks deltarl quantizes to. 128 x 128 is the layout of DeepSeek-style checkpoints,
which vLLM serves on Hopper with its CUTLASS block kernels; 64 x 64 is for models whose fused
projections are not whole 128-row blocks (SmolLM2-135M: hidden size 576, k/v 192 rows), which
vLLM serves with its Triton block kernel (docs/vllm.md, fp8 workers)."""

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value; scale = amax / E4M3_MAX."""

SCALE_FLOOR = 2.0**-126
"""Smallest scale (the smallest normal float32): the scale of an all-zero block."""

SCALE_SUFFIX = "_scale_inv"
"""A quantized tensor ``name`` keeps its scales in ``name + SCALE_SUFFIX``."""

FP8_DTYPE = torch.float8_e4m3fn

KEPT_MODULES = re.compile(
    r"(^|\.)(embed_tokens|embed_in|embeddings|word_embeddings|wte|wpe|lm_head|embed_out|"
    r"gate|router|shared_expert_gate|score|classifier)$"
)
"""Modules whose weights stay in higher precision although they are 2-D (matched against the
name without ``.weight``): embeddings, the LM head and MoE routers."""


def _is_norm(name: str) -> bool:
    """A norm's weight (``*norm*`` or ``ln*`` modules: RMSNorm, LayerNorm, q/k norms)."""
    leaf = name.removesuffix(".weight").removesuffix(".bias").rsplit(".", 1)[-1].lower()
    return "norm" in leaf or leaf.startswith("ln")


def scale_name(name: str) -> str:
    """The scale tensor of quantized tensor ``name``: ``"x.weight"`` -> ``"x.weight_scale_inv"``."""
    return name + SCALE_SUFFIX


def is_quantized(name: str, shape: Iterable[int], dtype: torch.dtype | None = None) -> bool:
    """Whether tensor ``name`` of ``shape`` is published (and served) in block fp8.

    The rule (module docstring): floating-point, 2-D ``*.weight`` of a linear layer, or 3-D
    stacked experts (``.experts.`` in the name); never an embedding, the LM head, a router, a
    norm, a bias or a scale. ``dtype``: the tensor's dtype when known (integer tensors are never
    quantized)."""
    shape = tuple(int(s) for s in shape)
    if dtype is not None and not dtype.is_floating_point:
        return False
    if name.endswith(SCALE_SUFFIX) or _is_norm(name):
        return False
    if len(shape) == 3:
        return ".experts." in name or name.endswith(".experts")
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    return KEPT_MODULES.search(name.removesuffix(".weight")) is None


def scale_shape(shape: Iterable[int], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """Shape of the scales of a tensor of ``shape``: the leading dimensions, then
    ``ceil(rows / block[0])``, ``ceil(cols / block[1])``."""
    *lead, rows, cols = (int(s) for s in shape)
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def quantize_block_fp8(
    t: torch.Tensor, block: tuple[int, int] = BLOCK, *, name: str = "tensor", check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 values, float32 scales)`` of ``t`` (2-D or more; blocks over the last two
    dimensions), on ``t``'s device, contiguous. The rule is the module docstring's.
    ``check``: raise ValueError on non-finite values (a wait for the device); without it a
    non-finite block gets a non-finite scale, which :func:`quantize_state` refuses later."""
    if t.dim() < 2:
        raise ValueError(f"{name}: block fp8 needs at least 2 dimensions, got {list(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name}: {t.dtype} is not a floating-point tensor")
    *lead, rows, cols = t.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    if rows == 0 or cols == 0:
        empty = torch.zeros((*lead, nr, nc), dtype=torch.float32, device=t.device)
        return torch.empty(t.shape, dtype=FP8_DTYPE, device=t.device), empty.fill_(SCALE_FLOOR)
    # [B, rows, nc * bc]: leading dimensions flattened, columns padded to whole blocks with
    # zeros (they never raise an amax; an edge block's amax is that of its real elements)
    x = t.detach().reshape(-1, rows, cols).to(torch.float32)
    if nc * bc != cols:
        x = torch.nn.functional.pad(x, (0, nc * bc - cols))
    cells = x.view(x.shape[0], rows, nc, bc)
    # amax per (row, column block), then per block of rows: two reductions over contiguous
    # or short dimensions, several times faster than one over the 4-D block view
    row_amax = cells.abs().amax(dim=-1)
    if nr * br != rows:
        row_amax = torch.nn.functional.pad(row_amax, (0, 0, 0, nr * br - rows))
    amax = row_amax.view(x.shape[0], nr, br, nc).amax(dim=2)
    if check and not bool(torch.isfinite(amax).all()):
        raise _non_finite(name)
    scale = _scales_of(amax)
    per_row = scale.repeat_interleave(br, dim=1)[:, :rows, :, None]  # [B, rows, nc, 1]
    q = (cells / per_row).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    q = q.view(x.shape[0], rows, nc * bc)[..., :cols].reshape(t.shape).contiguous()
    return q, scale.reshape(*lead, nr, nc).contiguous()


def _non_finite(name: str) -> ValueError:
    return ValueError(f"{name}: holds non-finite values, which block fp8 cannot represent")


def _scales_of(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 raised to the floor. Tensor / tensor, never a Python or 0-dim divisor (which
    some kernels turn into a multiplication by its reciprocal): a correctly rounded float32
    division on every device."""
    scale = amax / torch.full_like(amax, E4M3_MAX)
    return torch.clamp(scale, min=SCALE_FLOOR)


def partial_amax(
    rows: torch.Tensor, lo: int, total_rows: int, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """Row-sharded quantization, step 1 (an FSDP rank holding rows ``lo .. lo + len(rows) - 1``
    of a 2-D weight of ``total_rows`` rows): the amax of every block over *these* rows only,
    in the whole tensor's grid ``[ceil(total_rows / 128), ceil(cols / 128)]`` (0 for blocks with
    none of these rows). The element-wise max of every rank's grid (an all-reduce MAX: exact
    and order-free) is the whole tensor's amax grid, identical on every rank."""
    if rows.dim() != 2:
        raise ValueError(f"row-sharded quantization takes 2-D rows, got {list(rows.shape)}")
    n, cols = rows.shape
    br, bc = block
    grid = torch.zeros(
        -(-total_rows // br), -(-cols // bc), dtype=torch.float32, device=rows.device
    )
    if n == 0:
        return grid
    first, last = lo // br, (lo + n - 1) // br
    x = rows.detach().to(torch.float32).abs()
    padded = x.new_zeros(((last - first + 1) * br, grid.shape[1] * bc))
    padded[lo - first * br : lo - first * br + n, :cols] = x
    amax = padded.view(last - first + 1, br, grid.shape[1], bc).amax(dim=(1, 3))
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("rows hold non-finite values, which block fp8 cannot represent")
    grid[first : last + 1] = amax
    return grid


def quantize_rows(
    rows: torch.Tensor, lo: int, amax: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-sharded quantization, step 2: the e4m3 values of ``rows`` (starting at row ``lo``)
    under the whole tensor's ``amax`` grid (reduced from :func:`partial_amax`), and the
    whole scale grid. Bit-identical to the same rows of :func:`quantize_block_fp8` of the
    whole tensor, which is what makes a block straddling two ranks safe: both derive its
    scale from the same reduced amax."""
    scale = _scales_of(amax)
    n, cols = rows.shape
    if n == 0:
        return torch.empty(rows.shape, dtype=FP8_DTYPE, device=rows.device), scale
    idx = torch.arange(lo, lo + n, device=rows.device) // block[0]
    per = scale[idx].repeat_interleave(block[1], dim=1)[:, :cols]
    q = (rows.detach().to(torch.float32) / per).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale


def owned_scale_rows(lo: int, hi: int, block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """The scale rows ``[first, end)`` that the rank holding weight rows ``[lo, hi)`` publishes:
    the blocks whose *first* row it holds. Over ranks whose row ranges tile a tensor, these
    tile its scale grid (a rank inside one block owns none: ``first == end``)."""
    return -(-lo // block[0]), -(-hi // block[0])


def dequantize_block_fp8(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """``q * scale`` per block, as float32 (what a block-fp8 GEMM multiplies by)."""
    *_, rows, cols = q.shape
    s = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return q.to(torch.float32) * s[..., :rows, :cols]


def quantize_state(
    state: Mapping[str, torch.Tensor], block: tuple[int, int] = BLOCK
) -> dict[str, torch.Tensor]:
    """The block-fp8 version of ``state``: every tensor :func:`is_quantized` selects becomes its
    e4m3 values (same name) plus its scales (:func:`scale_name`); every other tensor is kept
    as it is (the same tensor object, not a copy), and so is a tensor already in e4m3 beside its
    scales (quantized where it lived, e.g. on its GPU, unchecked: a non-finite scale is refused
    here). Refuses a state that already holds a
    name a scale would take, and e4m3 without its scales."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        sname = scale_name(name)
        if t.dtype == FP8_DTYPE and is_quantized(name, t.shape):
            if sname not in state:
                raise ValueError(f"{name}: e4m3 values without their scales {sname!r}")
            if not bool(torch.isfinite(state[sname]).all()):  # quantized unchecked
                raise _non_finite(name)
            out[name] = t
            continue
        if not is_quantized(name, t.shape, t.dtype):
            out[name] = t
            continue
        if sname in state:
            raise ValueError(f"{name}: the state already holds a tensor named {sname!r}")
        out[name], out[sname] = quantize_block_fp8(t, block, name=name)
    return out


def fp8_layout(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], block: tuple[int, int] = BLOCK
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Dtype and shape of every tensor of the fp8 version of a state whose tensors are
    ``specs`` (name -> (dtype, shape)), as :func:`quantize_state` lays it out (what an fp8
    worker's engine must expose)."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, (dtype, shape) in specs.items():
        shape = tuple(int(s) for s in shape)
        if is_quantized(name, shape, dtype):
            out[name] = (FP8_DTYPE, shape)
            out[scale_name(name)] = (torch.float32, scale_shape(shape, block))
        else:
            out[name] = (dtype, shape)
    return out


def kept_modules(names: Iterable[str], shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Modules of 2-D ``*.weight`` tensors the rule keeps in higher precision (sorted): what a
    checkpoint lists in ``modules_to_not_convert`` so that vLLM keeps them too."""
    out = {
        n.removesuffix(".weight")
        for n in names
        if n.endswith(".weight")
        and len(shapes[n]) == 2
        and not _is_norm(n)
        and not is_quantized(n, shapes[n])
    }
    return sorted(out)


def quantization_config(
    state: Mapping[str, torch.Tensor] | None = None, block: tuple[int, int] = BLOCK
) -> dict[str, Any]:
    """The checkpoint's ``quantization_config`` for vLLM (``config.json``): block fp8 with
    dynamic activations, and, given the bf16 ``state``, the kept 2-D modules in
    ``modules_to_not_convert`` (vLLM matches them exactly against its module names, which for
    these unfused modules are the checkpoint's)."""
    config: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    if state is not None:
        shapes = {n: tuple(t.shape) for n, t in state.items()}
        config["modules_to_not_convert"] = kept_modules(state, shapes)
    return config


def block_of(side: int) -> tuple[int, int]:
    """The square block of ``side`` (one of :data:`BLOCK_SIDES`); a ValueError otherwise."""
    if side not in BLOCK_SIDES:
        raise ValueError(
            f"block fp8 in {side} x {side} blocks: deltarl quantizes to "
            f"{' or '.join(f'{b} x {b}' for b in BLOCK_SIDES)} blocks"
        )
    return side, side


def config_block(config: Any) -> tuple[int, int] | None:
    """The block of a checkpoint's ``quantization_config`` (a dict, or an object with those
    attributes) when it is the block fp8 this module produces (``quant_method`` fp8, dynamic
    activations, square ``weight_block_size`` of a side in :data:`BLOCK_SIDES`); None when it is
    not block fp8 at all. A block-fp8 config in another block is a ValueError naming it."""

    def get(key: str) -> Any:
        return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

    if config is None or get("quant_method") != "fp8" or get("weight_block_size") is None:
        return None
    if get("activation_scheme") not in (None, "dynamic"):
        return None
    try:
        rows, cols = (int(b) for b in get("weight_block_size"))
    except (TypeError, ValueError):
        raise ValueError(
            f"quantization_config.weight_block_size {get('weight_block_size')!r}: not two integers"
        ) from None
    if rows != cols or rows not in BLOCK_SIDES:
        raise ValueError(
            f"quantization_config.weight_block_size [{rows}, {cols}]: deltarl quantizes to "
            f"{' or '.join(f'[{b}, {b}]' for b in BLOCK_SIDES)} blocks"
        )
    return rows, cols


def is_block_fp8_config(config: Any) -> bool:
    """Whether a checkpoint's ``quantization_config`` is block fp8 that deltarl produces
    (:func:`config_block`)."""
    return config_block(config) is not None


def fp8_bytes(shape: Iterable[int], block: tuple[int, int] = BLOCK) -> int:
    """Bytes of one quantized tensor as served: one per element plus 4 per block."""
    shape = tuple(int(s) for s in shape)
    return math.prod(shape) + 4 * math.prod(scale_shape(shape, block))


__all__ = [
    "BLOCK",
    "BLOCK_SIDES",
    "E4M3_MAX",
    "FP8_DTYPE",
    "SCALE_FLOOR",
    "SCALE_SUFFIX",
    "block_of",
    "config_block",
    "dequantize_block_fp8",
    "fp8_bytes",
    "fp8_layout",
    "is_block_fp8_config",
    "is_quantized",
    "kept_modules",
    "owned_scale_rows",
    "partial_amax",
    "quantization_config",
    "quantize_block_fp8",
    "quantize_rows",
    "quantize_state",
    "scale_name",
    "scale_shape",
]
