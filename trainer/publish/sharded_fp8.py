"""Block-fp8 versions under FSDP2: every rank quantizes its own rows, bit-identical to the
whole tensor's quantization (:func:`~deltarl.weightsync.fp8.quantize_state`) of one process.

FSDP2 (``Shard(0)``) gives rank ``r`` rows ``[r c, min((r + 1) c, rows))`` of every parameter,
``c = ceil(rows / world)``, so a 128 x 128 block straddles two ranks whenever a boundary is not a
multiple of 128 (more than two when ``c < 128``), and its scale needs the amax of all its rows.
:func:`quantize_local_rows` (a collective; every rank calls it with its rows of the same model):

1. one ``all_gather_object`` of every rank's row ranges of the quantized tensors (names and
   numbers only): every rank then knows each tensor's whole row count and whether any rank
   boundary falls inside a block (*straddled*);
2. for the straddled 2-D tensors only, every rank computes the amax of each block over its own
   rows (:func:`~deltarl.weightsync.fp8.partial_amax`, in the whole tensor's block grid), and
   one ``all_reduce(MAX)`` of the concatenated grids (4 bytes per 16,384 elements; max is
   exact and order-free) gives every rank the same amax, hence the same scales. A rank whose
   rows hold a non-finite value raises a flag in the same reduce, so every rank stops together;
3. every rank quantizes its rows (:func:`~deltarl.weightsync.fp8.quantize_rows`; a tensor no
   boundary splits, and stacked experts, which ``Shard(0)`` splits by expert, are quantized
   locally by :func:`~deltarl.weightsync.fp8.quantize_block_fp8`): the e4m3 rows are published
   under the rank's slice key ``name[lo:hi]``;
4. **who owns a block's scale**: the rank holding the block's *first* row publishes its scale
   row, ``name_scale_inv[first:end]`` with ``(first, end) = owned_scale_rows(lo, hi)``; these
   ranges tile the scale grid (a rank whose rows lie inside one block owns none). Stacked
   experts publish ``name_scale_inv[lo:hi]`` over the same experts as their values.

So the bytes of a sharded fp8 version are those of one process's fp8 version of the same
state; its digests are over the slice keys (the layout), as for any sharded version, and a
worker reads it through :func:`~deltarl.weightsync.sharding.layout_view` unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as tdist

from deltarl.weightsync.fp8 import (
    BLOCK,
    is_quantized,
    owned_scale_rows,
    partial_amax,
    quantize_block_fp8,
    quantize_rows,
    scale_name,
    scale_shape,
)
from deltarl.weightsync.manifest import parse_slice_key, slice_key

__all__ = ["RowLayout", "quantize_local_rows", "straddled"]

RowLayout = dict[str, tuple[tuple[int, ...], list[tuple[int, int]]]]
"""Quantized tensor name -> (whole shape, every rank's row ranges ``[lo, hi)``, sorted)."""


def straddled(ranges: list[tuple[int, int]], block: tuple[int, int] = BLOCK) -> bool:
    """Whether a rank boundary of a 2-D tensor split into ``ranges`` falls inside a block."""
    return any(lo % block[0] for lo, _ in ranges)


def _gather_layout(local: Mapping[str, tuple[int, int, tuple[int, ...]]], world: int) -> RowLayout:
    """Every rank's row ranges of the quantized tensors (``local``: this rank's, name -> (lo,
    hi, local shape)), as one layout on every rank (a collective)."""
    every: list[object] = [None] * world
    tdist.all_gather_object(every, dict(local))
    ranges: dict[str, list[tuple[int, int]]] = {}
    total: dict[str, int] = {}
    trailing: dict[str, tuple[int, ...]] = {}
    for part in every:
        assert isinstance(part, dict)
        for name, (lo, hi, shape) in part.items():
            ranges.setdefault(name, []).append((lo, hi))
            total[name] = max(total.get(name, 0), hi)
            trailing[name] = tuple(shape[1:])
    layout: RowLayout = {}
    for name, r in sorted(ranges.items()):
        r.sort()
        ends = [0, *[hi for _, hi in r]]
        if [lo for lo, _ in r] != ends[:-1]:
            raise ValueError(f"{name}: the ranks' rows do not tile the tensor: {r}")
        layout[name] = ((total[name], *trailing[name]), r)
    return layout


def _comm_device() -> torch.device:
    """Where the process group's collectives take tensors (NCCL: this rank's GPU)."""
    if tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def quantize_local_rows(
    state: Mapping[str, torch.Tensor],
    dtype_of: Callable[[str], torch.dtype],
    world: int,
    block: tuple[int, int] = BLOCK,
    layout: RowLayout | None = None,
) -> tuple[dict[str, torch.Tensor], RowLayout]:
    """This rank's share of the block-fp8 version (the module docstring; a collective).

    ``state``: this rank's rows by slice key (:func:`~.sharded.local_rows`, fp32 masters);
    ``dtype_of``: the precision each is published in before quantization (bf16, or float32 for
    the tensors a model keeps in float32), as one process quantizes the bf16 cast. Returns the
    published rows by slice key (e4m3 rows, owned scale rows, the rest cast by ``dtype_of``;
    all new tensors except where the cast is a no-op) and the names of every quantized tensor
    of the model (all ranks'), which are published in e4m3 with ``name + "_scale_inv"`` in
    float32.

    ``layout``: what a previous version returned (the ranks' row ranges do not change during a
    job), which saves the gather: on a 1T-parameter model with ~70,000 quantized tensors over
    256 ranks it is ~1 GB of pickled names received by every rank. Every rank of a job must pass
    one (or none) alike; a rank whose rows differ from it fails the version on every rank."""
    local: dict[str, tuple[int, int, tuple[int, ...]]] = {}
    names = {parse_slice_key(k)[0] for k in state}
    error = None  # raised after the collectives, which every rank must reach
    for key, t in state.items():
        name, lo, hi = parse_slice_key(key)
        if is_quantized(name, t.shape, dtype_of(key)):
            if scale_name(name) in names:
                error = f"{name}: the state already holds a tensor named {scale_name(name)!r}"
            local[name] = (lo, hi, tuple(int(s) for s in t.shape))
    if layout is None:
        layout = _gather_layout(local, world)
    else:
        moved = [
            n
            for n, (lo, hi, shape) in local.items()
            if n not in layout or (lo, hi) not in layout[n][1] or shape[1:] != layout[n][0][1:]
        ]
        if moved or len(local) != sum(1 for n in layout if n in names):
            error = (
                f"this rank's rows of {moved[:3] or 'its tensors'} differ from the last version's"
            )
    reduced = sorted(
        n for n, (shape, r) in layout.items() if len(shape) == 2 and straddled(r, block)
    )
    grids = _reduced_amax(state, local, layout, reduced, dtype_of, block, error)

    out: dict[str, torch.Tensor] = {}
    for key in sorted(state):
        name, lo, hi = parse_slice_key(key)
        rows = state[key].detach().to(dtype_of(key))
        if name not in local:
            out[key] = rows
            continue
        if name in grids:
            q, scale = quantize_rows(rows, lo, grids[name].to(rows.device), block)
            first, end = owned_scale_rows(lo, hi, block)
            own = scale[first:end]
        else:  # no boundary inside a block (or stacked experts): the rows' own blocks
            q, own = quantize_block_fp8(rows, block, name=name)
            first, end = (lo, hi) if rows.dim() == 3 else owned_scale_rows(lo, hi, block)
        out[key] = q
        if end > first:
            out[slice_key(scale_name(name), first, end)] = own.contiguous()
    return out, layout


def _reduced_amax(
    state: Mapping[str, torch.Tensor],
    local: Mapping[str, tuple[int, int, tuple[int, ...]]],
    layout: RowLayout,
    names: list[str],
    dtype_of: Callable[[str], torch.dtype],
    block: tuple[int, int],
    error: str | None,
) -> dict[str, torch.Tensor]:
    """The whole amax grid of every tensor in ``names`` (straddled 2-D tensors), reduced over
    the ranks: one ``all_reduce(MAX)`` of the concatenated grids and an error flag (raised by
    a rank that found ``error`` or non-finite rows; every rank then raises)."""
    by_name = {parse_slice_key(k)[0]: k for k in state}
    shapes = [scale_shape(layout[n][0], block) for n in names]
    sizes = [s[0] * s[1] for s in shapes]
    flat = torch.zeros(sum(sizes) + 1, dtype=torch.float32, device=_comm_device())
    at = 0
    for name, size in zip(names, sizes, strict=True):
        if name in local:
            lo, _, _ = local[name]
            key = by_name[name]
            try:
                grid = partial_amax(
                    state[key].detach().to(dtype_of(key)), lo, layout[name][0][0], block
                )
            except ValueError as err:  # still take part in the reduce below
                error = f"{name}: {err}"
            else:
                flat[at : at + size] = grid.reshape(-1).to(flat.device)
        at += size
    if error is not None:
        flat[-1] = 1.0
    tdist.all_reduce(flat, op=tdist.ReduceOp.MAX)
    if error is not None:
        raise ValueError(error)
    if float(flat[-1]) > 0:
        raise ValueError("another rank could not quantize its rows (see that rank's log)")
    out, at = {}, 0
    for name, shape, size in zip(names, shapes, sizes, strict=True):
        out[name] = flat[at : at + size].view(shape)
        at += size
    return out
