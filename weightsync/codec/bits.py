"""Bit-level views of floating-point tensors.

The codec never does floating-point arithmetic on weights: it compares, diffs and stores their bit
patterns, so every round trip is exact, NaN payloads, infinities and ``-0.0`` included.

=============  ==========  ==============  ==============
dtype          bits view   exponent bits   mantissa bits
=============  ==========  ==============  ==============
bfloat16       int16       8               7
float16        int16       5               10
float32        int32       8               23
float8_e4m3fn  int8        4               3
=============  ==========  ==============  ==============

``float8_e4m3fn`` is block fp8's value type (``weightsync/fp8.py``): one byte, sign,
4 exponent bits (bias 7), 3 mantissa bits, no infinities, NaN only at ``S.1111.111``. Its bytes
are coded exactly like the wider formats' bit patterns (an "ULP step" is +-1 on the byte).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class FloatFormat:
    """How one floating-point dtype is laid out.

    Example::

        >>> FLOAT_FORMATS["bfloat16"].mantissa_bits
        7
    """

    name: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    torch_dtype: torch.dtype
    bits_dtype: np.dtype  # signed integer numpy dtype of the same width
    width: int  # bits per element
    mantissa_bits: int
    exponent_bits: int

    @property
    def exponent_mask(self) -> int:
        return (1 << self.exponent_bits) - 1

    @property
    def safetensors_dtype(self) -> str:
        return {
            "bfloat16": "BF16",
            "float16": "F16",
            "float32": "F32",
            "float8_e4m3fn": "F8_E4M3",
        }[self.name]


FLOAT_FORMATS: dict[str, FloatFormat] = {
    "bfloat16": FloatFormat("bfloat16", torch.bfloat16, np.dtype(np.int16), 16, 7, 8),
    "float16": FloatFormat("float16", torch.float16, np.dtype(np.int16), 16, 10, 5),
    "float32": FloatFormat("float32", torch.float32, np.dtype(np.int32), 32, 23, 8),
    "float8_e4m3fn": FloatFormat("float8_e4m3fn", torch.float8_e4m3fn, np.dtype(np.int8), 8, 3, 4),
}

_BITS_TORCH = {8: torch.int8, 16: torch.int16, 32: torch.int32}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def float_format(dtype: torch.dtype | str) -> FloatFormat:
    """Return the layout of ``dtype``; other dtypes are refused with a clear message."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    try:
        return FLOAT_FORMATS[name]
    except KeyError:
        supported = ", ".join(FLOAT_FORMATS)
        raise ValueError(
            f"dtype {name!r} is not supported by the delta codec (supported: {supported})"
        ) from None


def _bits_dtype(t: torch.Tensor) -> torch.dtype:
    """The integer dtype of ``t``'s bit patterns (``t`` a contiguous float tensor)."""
    fmt = float_format(t.dtype)
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous to be viewed as bits")
    return _BITS_TORCH[fmt.width]


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """Flat integer view of a contiguous float tensor, sharing its storage (no copy)."""
    return t.view(-1).view(_bits_dtype(t))


def bits_numpy(t: torch.Tensor) -> np.ndarray:
    """Flat numpy integer view of a contiguous CPU float tensor (no copy).

    One torch call (a dispatched op hands the GIL over, and next to a busy Python thread,
    such as a rollout engine's, taking it back waits up to a switch interval): the flat view is
    numpy's."""
    if t.device.type != "cpu":
        raise ValueError(f"expected a CPU tensor, got one on {t.device}")
    return t.view(_bits_dtype(t)).numpy().reshape(-1)


def from_bits(bits: np.ndarray, dtype: torch.dtype | str, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor of ``dtype`` and ``shape`` whose bit patterns are ``bits`` (copies nothing)."""
    fmt = float_format(dtype)
    arr = np.ascontiguousarray(bits, dtype=fmt.bits_dtype)
    return torch.from_numpy(arr).view(fmt.torch_dtype).reshape(shape)
