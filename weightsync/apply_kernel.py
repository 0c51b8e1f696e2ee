"""One-launch apply of a staged delta on CUDA: a Triton kernel that stores ``value[i]`` at the
absolute device address ``address[i]``.

Why: the per-tensor ``index_copy_`` loop of :func:`~.delta.apply_staged` costs one launch (and
a GIL release, at which a generating thread can take the GIL for up to the switch interval) per
changed tensor, ~180-270 for SmolLM2, inside the paused window. Addresses are built at staging
time (outside the pause) by :func:`~.delta.stage_delta`: ``target.data_ptr() + index *
element_size`` on the device, one int64 buffer per value bit width, aligned with that width's
packed value buffer. The paused window is then one launch per bit width plus the synchronize.

Semantics are those of the ``index_copy_`` loop it replaces, bit for bit: every element is a
raw 8-, 16- or 32-bit store of the delta's absolute new bit pattern (no arithmetic on values).
Indices are unique within a tensor (a :class:`~.delta.TensorPatch` holds strictly increasing
indices; the codec's decoders and the TRL reader refuse anything else) and distinct tensors do
not overlap (different parameters, or disjoint views into one fused parameter), so no element is
written twice and the order of stores does not matter. Indices are bounds-checked on the host at
staging (:func:`~.delta.stage_delta`), since a raw store has no bounds check of its own.

Selection (``kernel`` argument of :func:`~.delta.stage_delta`, the rollout worker's
``DELTARL_ROLLOUT_APPLY_KERNEL``): ``"auto"`` uses the kernel on CUDA when Triton imports and
its warm-up passed, else the ``index_copy_`` loop; ``"triton"`` insists (an error if it cannot);
``"torch"`` always uses the loop (the kill switch).

This module imports Triton (if installed) on import: import it only on the CUDA path.
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)

try:  # pragma: no cover - Triton is only installed on GPU machines
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU images
    triton = None
    tl = None

KERNEL_MODES = ("auto", "triton", "torch")
BLOCK = 1024

_lock = threading.Lock()
_warm: set[tuple[torch.device, torch.dtype]] = set()
_broken: str | None = None  # why the kernel is off for this process ("auto" falls back)


if triton is not None:  # pragma: no cover - GPU only
    # ``n`` is not specialized (Triton would otherwise compile a variant for n == 1 and for n
    # divisible by 16, and a variant first met inside a pause would compile there); both
    # buffers are whole fresh allocations (aligned), as in the warm-up, so the pointer
    # specialization is always the warmed one.
    @triton.jit(do_not_specialize=["n"])
    def _store_at(addr_ptr, val_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        addr = tl.load(addr_ptr + offs, mask=mask, other=0)
        val = tl.load(val_ptr + offs, mask=mask, other=0)
        tl.store(addr.to(tl.pointer_type(val_ptr.dtype.element_ty)), val, mask=mask)


def triton_available() -> bool:
    """Triton imported and CUDA present."""
    return triton is not None and torch.cuda.is_available()


def broken_reason() -> str | None:
    """Why the kernel was switched off in this process (a failed warm-up or launch), if it was."""
    return _broken


def use_kernel(mode: str, device: torch.device) -> bool:
    """Whether to apply with the kernel on ``device`` under ``mode`` (see the module docstring).

    ``"triton"`` raises ``ValueError`` where the kernel cannot run.
    """
    if mode not in KERNEL_MODES:
        raise ValueError(f"apply kernel must be one of {KERNEL_MODES}, got {mode!r}")
    if mode == "torch":
        return False
    ok = device.type == "cuda" and triton_available() and _broken is None
    if mode == "triton" and not ok:
        why = (
            f"the device is {device}, not CUDA"
            if device.type != "cuda"
            else "Triton is not installed"
            if triton is None
            else f"it was switched off: {_broken}"
        )
        raise ValueError(f"apply kernel 'triton' requested, but {why}")
    return ok


def warm_up(device: torch.device, dtypes: set[torch.dtype]) -> bool:
    """Compile (or load from Triton's cache) and load the kernel for these bit dtypes
    (``torch.int8`` / ``torch.int16`` / ``torch.int32``) on ``device``, and check it on a scratch buffer.

    Call it outside the paused window: the first launch compiles (up to seconds) and CUDA loads
    the module lazily. Idempotent and cheap once done. Returns False (and switches the kernel
    off for this process) if the kernel fails or writes the wrong bits.
    """
    global _broken
    if triton is None or _broken is not None:
        return False
    with _lock:
        for dtype in sorted(dtypes, key=str):
            if (device, dtype) in _warm:
                continue
            try:
                _check_on_scratch(device, dtype)
            except Exception as err:  # pragma: no cover - GPU only
                _broken = f"warm-up on {device} for {dtype} failed: {err!r}"
                logger.warning("apply kernel off, index_copy_ instead: %s", _broken)
                return False
            _warm.add((device, dtype))
    return True


def _check_on_scratch(device: torch.device, dtype: torch.dtype) -> None:  # pragma: no cover
    scratch = torch.zeros(2 * BLOCK + 3, dtype=dtype, device=device)
    es = scratch.element_size()
    picks = torch.tensor([0, 5, BLOCK, 2 * BLOCK + 2], dtype=torch.int64, device=device)
    addr = picks * es + scratch.data_ptr()
    picked = [-1, 7, -128, 127] if dtype == torch.int8 else [-1, 7, -300, 12345]
    val = torch.tensor(picked, dtype=dtype, device=device)
    launch(addr, val)
    torch.cuda.synchronize(device)
    expect = torch.zeros_like(scratch)
    expect[picks] = val
    if not torch.equal(scratch, expect):
        raise RuntimeError("the kernel wrote other bits than index_copy_ would")


def launch(addr: torch.Tensor, val: torch.Tensor) -> None:  # pragma: no cover - GPU only
    """Store ``val[i]`` at address ``addr[i]`` (int64 device addresses) on the current stream
    of ``val``'s device; asynchronous."""
    n = val.numel()
    if n == 0:
        return
    with torch.cuda.device(val.device):
        _store_at[(triton.cdiv(n, BLOCK),)](addr, val, n, BLOCK=BLOCK)


def switch_off(reason: str) -> None:
    """Use ``index_copy_`` from now on in this process (after a failed launch)."""
    global _broken
    _broken = reason
    logger.warning("apply kernel off, index_copy_ instead: %s", reason)
