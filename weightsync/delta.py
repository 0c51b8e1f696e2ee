"""The in-memory delta: which elements of which tensors changed, and their new bit patterns.

A :class:`Delta` takes a state dict from ``base_version`` to ``version`` bit-exactly. It is
independent of any file format (see ``compact.py``, ``trl_format.py``) and of the device: indices
and values are CPU numpy arrays, and :func:`apply_delta` scatters them in place into CPU or GPU
tensors without copying the model.

Guarantees:

* Every tensor of the state is listed, changed or not, with the digest of its base and result, so
  a tensor added, removed, reshaped or cast between versions is refused (:class:`StateMismatchError`).
* :func:`apply_delta` checks every base digest *before* writing any byte; values are absolute new
  bit patterns, so even a retried apply cannot double-count, and the base check refuses it anyway
  (the state is then at ``version``, whose digest differs from the base's).
* After writing, the result digests are verified (:class:`VerificationError` if not).
* A delta read from a file that carries no digests (a plain TRL delta) holds
  :data:`UNKNOWN_DIGEST`; :func:`apply_delta` refuses it unless both checks are switched off
  explicitly (``check_base=False, verify=False``), so "unchecked" is always the caller's choice.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from deltarl.weightsync.change_buffers import TORCH_OF_NUMPY, host_runs
from deltarl.weightsync.codec.bits import bits_view, dtype_name, float_format
from deltarl.weightsync.digest import combine_digests, state_digests, tensor_digest
from deltarl.weightsync.errors import (
    BaseMismatchError,
    CorruptDeltaError,
    DeltaError,
    StateMismatchError,
    VerificationError,
)

UNKNOWN_DIGEST = "unknown"
"""Digest placeholder for patches read from a file that records none (e.g. a plain TRL delta).

Never a valid digest (those are lowercase hex), so it can never match a state by accident.
"""


@dataclass(slots=True)
class TensorPatch:
    """Changes to one tensor.

    Example::

        TensorPatch(name="lm_head.weight", dtype="bfloat16", shape=(8, 4),
                    index=np.array([3, 17]), value=np.array([16256, -16512], np.int16),
                    base_digest="...", result_digest="...")
    """

    name: str
    dtype: str  # "bfloat16" | "float16" | "float32" | "float8_e4m3fn"
    shape: tuple[int, ...]
    index: np.ndarray  # int64 [k], strictly increasing flat (C-order) indices of changed elements
    value: np.ndarray  # int8/int16/int32 [k], new bit patterns at those indices
    base_digest: str  # tensor_digest of the tensor at base_version
    result_digest: str  # tensor_digest of the tensor at version

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def changed(self) -> int:
        return int(self.index.size)


@dataclass(slots=True)
class Delta:
    """All patches that take a state from ``base_version`` to ``version``.

    ``base_version`` is ``None`` only for deltas computed outside any versioned chain (the CLI on
    two loose files).
    """

    base_version: int | None
    version: int | None
    patches: dict[str, TensorPatch]

    @property
    def base_digest(self) -> str:
        return combine_digests({n: p.base_digest for n, p in self.patches.items()})

    @property
    def result_digest(self) -> str:
        return combine_digests({n: p.result_digest for n, p in self.patches.items()})

    @property
    def digests_known(self) -> bool:
        """False if any patch lacks its base or result digest (:data:`UNKNOWN_DIGEST`)."""
        return all(
            UNKNOWN_DIGEST not in (p.base_digest, p.result_digest) for p in self.patches.values()
        )

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.patches.values())

    @property
    def changed(self) -> int:
        return sum(p.changed for p in self.patches.values())

    @property
    def density(self) -> float:
        n = self.numel
        return self.changed / n if n else 0.0

    @property
    def dense_bytes(self) -> int:
        """Bytes of a full checkpoint of the result state (what a full sync would ship)."""
        return sum(p.numel * float_format(p.dtype).width // 8 for p in self.patches.values())


def check_compatible(state: Mapping[str, torch.Tensor], patches: Mapping[str, TensorPatch]) -> None:
    """Refuse, with the first few differences named, a state whose tensors differ from the delta's."""
    problems: list[str] = []
    missing = sorted(set(patches) - set(state))
    extra = sorted(set(state) - set(patches))
    if missing:
        problems.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for name in sorted(set(state) & set(patches)):
        t, p = state[name], patches[name]
        if dtype_name(t.dtype) != p.dtype or tuple(t.shape) != p.shape:
            problems.append(
                f"{name}: state has {dtype_name(t.dtype)}{list(t.shape)}, delta expects {p.dtype}{list(p.shape)}"
            )
        if len(problems) >= 8:
            break
    if problems:
        raise StateMismatchError("state does not match the delta: " + "; ".join(problems))


def changed_elements(old: torch.Tensor, new: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices (int64) and new bit patterns of the elements whose bits differ (CPU numpy
    arrays; on a GPU the comparison runs there and only the changed elements come back)."""
    ob, nb = bits_view(old.contiguous()), bits_view(new.contiguous())
    if ob.device.type == "cpu" and nb.device.type == "cpu":
        o, n = ob.numpy(), nb.numpy()
        idx = np.flatnonzero(o != n).astype(np.int64, copy=False)
        return idx, n[idx]
    tidx = torch.nonzero(ob != nb).view(-1)
    return tidx.cpu().numpy().astype(np.int64, copy=False), nb[tidx].cpu().numpy()


def compute_delta(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    base_version: int | None = None,
    version: int | None = None,
    old_digests: Mapping[str, str] | None = None,
) -> Delta:
    """Delta from ``old`` to ``new`` (same names, dtypes and shapes; CPU or GPU tensors).

    ``old_digests`` (tensor digests of ``old``, e.g. remembered from the previous publish) saves
    hashing ``old`` again.
    """
    if set(old) != set(new):
        added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        raise StateMismatchError(
            f"tensors differ between versions: added {added[:5]}, removed {removed[:5]}"
        )
    patches: dict[str, TensorPatch] = {}
    for name in sorted(new):
        o, n = old[name], new[name]
        if o.dtype != n.dtype or o.shape != n.shape:
            raise StateMismatchError(
                f"{name}: {dtype_name(o.dtype)}{list(o.shape)} became {dtype_name(n.dtype)}{list(n.shape)}"
            )
        fmt = float_format(n.dtype)
        index, value = changed_elements(o, n)
        patches[name] = TensorPatch(
            name=name,
            dtype=fmt.name,
            shape=tuple(n.shape),
            index=index,
            value=value.astype(fmt.bits_dtype, copy=False),
            base_digest=old_digests[name] if old_digests is not None else tensor_digest(o),
            result_digest=tensor_digest(n),
        )
    return Delta(base_version=base_version, version=version, patches=patches)


def verify_base(
    state: Mapping[str, torch.Tensor], delta: Delta, state_digests: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`BaseMismatchError` unless ``state`` is exactly the delta's base."""
    _refuse_unknown_digests(delta)
    check_compatible(state, delta.patches)
    wrong = []
    for name, p in delta.patches.items():
        have = state_digests[name] if state_digests is not None else tensor_digest(state[name])
        if have != p.base_digest:
            wrong.append(name)
    if wrong:
        already = all(tensor_digest(state[n]) == delta.patches[n].result_digest for n in wrong[:3])
        hint = (
            " (it already holds the delta's result: was the delta applied twice?)"
            if already
            else ""
        )
        raise BaseMismatchError(
            f"state is not the base of this delta (version {delta.base_version} -> {delta.version}): "
            f"{len(wrong)} tensor(s) differ, e.g. {wrong[:3]}{hint}; nothing was written"
        )


def _refuse_unknown_digests(delta: Delta) -> None:
    if not delta.digests_known:
        raise DeltaError(
            f"delta {delta.base_version} -> {delta.version} carries no digests (e.g. a plain TRL "
            "file), so its base cannot be checked nor its result verified; apply it unchecked with "
            "check_base=False, verify=False, or attach digests computed from the local base first "
            "(trl_format.with_local_digests); nothing was written"
        )


def scatter_patch(t: torch.Tensor, patch: TensorPatch) -> None:
    """Write ``patch`` into ``t`` in place (one indexed copy; ``t`` may live on any device)."""
    if patch.index.size == 0:
        return
    flat = bits_view(t)
    idx = torch.from_numpy(patch.index).to(flat.device, non_blocking=True)
    val = torch.from_numpy(patch.value).to(flat.device, non_blocking=True)
    flat.index_copy_(0, idx, val)


def apply_delta(
    state: MutableMapping[str, torch.Tensor],
    delta: Delta,
    *,
    check_base: bool = True,
    verify: bool = True,
    state_digests: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Apply ``delta`` to ``state`` in place and return the new tensor digests.

    Order: compatibility and base digests are checked for every tensor first (nothing is written
    if any fails), then every patch is scattered, then every result digest is verified. A
    :class:`VerificationError` after writing means ``state`` is poisoned.
    ``state_digests`` are trusted digests of ``state`` (skips hashing it for the base check).
    A delta without digests (:attr:`Delta.digests_known` false) is refused before anything is
    written unless ``check_base`` and ``verify`` are both false.
    """
    if check_base or verify:
        _refuse_unknown_digests(delta)
    if check_base:
        verify_base(state, delta, state_digests)
    else:
        check_compatible(state, delta.patches)
    for name, patch in delta.patches.items():
        t = state[name]
        if not t.is_contiguous():
            raise StateMismatchError(f"{name}: tensor is not contiguous; cannot patch it in place")
        scatter_patch(t, patch)
    if verify:
        return verify_result(state, delta)
    return {name: p.result_digest for name, p in delta.patches.items()}


def compose(deltas: Sequence[Delta]) -> Delta:
    """Squash consecutive deltas v->v+1->...->v+k into one v->v+k delta (last write wins).

    Needs no weights: patches hold absolute new values. Elements that changed and changed back are
    kept (harmless; the result digest still holds).
    """
    if not deltas:
        raise DeltaError("compose needs at least one delta")
    for a, b in itertools.pairwise(deltas):
        if a.result_digest != b.base_digest:
            raise BaseMismatchError(
                f"deltas do not chain: {a.base_version}->{a.version} ends in a different state than "
                f"{b.base_version}->{b.version} starts from"
            )
    first = deltas[0]
    out: dict[str, TensorPatch] = {}
    for name, p0 in first.patches.items():
        parts = [d.patches[name] for d in deltas]
        index = np.concatenate([p.index for p in parts])
        value = np.concatenate([p.value for p in parts])
        # stable sort by index, then keep the last occurrence of each index
        order = np.argsort(index, kind="stable")
        index, value = index[order], value[order]
        keep = np.ones(index.size, dtype=bool)
        if index.size:
            keep[:-1] = index[1:] != index[:-1]
        out[name] = TensorPatch(
            name=name,
            dtype=p0.dtype,
            shape=p0.shape,
            index=index[keep],
            value=value[keep],
            base_digest=p0.base_digest,
            result_digest=parts[-1].result_digest,
        )
    return Delta(base_version=first.base_version, version=deltas[-1].version, patches=out)


def iter_changed_tensors(delta: Delta) -> Iterable[TensorPatch]:
    return (p for p in delta.patches.values() if p.changed)


APPLY_KERNELS = ("auto", "triton", "torch")
"""How :func:`apply_staged` writes on CUDA (``kernel`` of :func:`stage_delta`): ``"auto"`` one
Triton launch per bit width where Triton runs, else ``"torch"`` (one ``index_copy_`` per changed
tensor, the fallback and kill switch); ``"triton"`` insists on the kernel (see apply_kernel.py)."""


@dataclass(slots=True)
class StagedDelta:
    """A delta whose indices and values already sit on the target device.

    Staging (host-to-device copies) happens while inference still runs; the paused window is then
    only :func:`apply_staged`, no allocation, no host round trip: on CUDA with the targets bound
    and the kernel selected, one store kernel per value bit width (``stores``: the absolute
    destination address of every changed element, built at staging, and the packed values of
    that width); otherwise one ``index_copy_`` per changed tensor. Build it with
    :func:`stage_delta`.
    """

    delta: Delta
    device: torch.device
    parts: list[tuple[str, torch.Tensor, torch.Tensor]]  # (name, int64 index, int16/32 values)
    # flat bit views of the target tensors, bound (and checked) at staging time when the state
    # was given; used only for that same state mapping
    targets: list[torch.Tensor] | None = None
    bound_to: Mapping[str, torch.Tensor] | None = None
    # per bit width: (int64 device addresses, values), aligned; only with bound targets
    stores: list[tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass(slots=True)
class _WidthGroup:
    """Consecutive parts ``parts[first:end]`` whose values share one buffer (one bit width); their
    indices are ``index`` (a slice of the shared index buffer, aligned with ``values``)."""

    first: int
    end: int
    index: torch.Tensor
    values: torch.Tensor
    counts: list[int]  # changed elements of each part


def stage_delta(
    delta: Delta,
    device: torch.device | str,
    state: Mapping[str, torch.Tensor] | None = None,
    *,
    kernel: str = "auto",
) -> StagedDelta:
    """Copy every non-empty patch of ``delta`` to ``device`` (pinned, asynchronous on CUDA).

    On CUDA all indices travel as one pinned buffer and the values as one buffer per bit width
    (a handful of host-to-device copies, not two per tensor); each part is a view into them.
    Why: every copy call releases the GIL, and a generating thread in the same process then
    holds it for up to the switch interval (5 ms), so 2 copies x ~300 tensors took 1.3-1.5 s on
    an H200 while generation ran, instead of milliseconds. Patches decoded into
    :func:`~.change_buffers.change_arrays` buffers are copied from them as they lie (one copy
    per buffer); others are gathered into pinned memory first.

    With ``state`` (the tensors the delta will be applied to), names, dtypes, shapes and devices
    are checked now and the targets bound, so that :func:`apply_staged` on that state does nothing
    but the scatters. On CUDA, where ``kernel`` (:data:`APPLY_KERNELS`) selects the store kernel,
    the destination addresses are built here too (on the device, indices bounds-checked on the
    host) and the kernel warmed up, so the pause is one launch per bit width.
    """
    if kernel not in APPLY_KERNELS:
        raise ValueError(f"kernel must be one of {APPLY_KERNELS}, got {kernel!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    use_kernel = False
    if kernel != "torch":
        from deltarl.weightsync import apply_kernel

        use_kernel = apply_kernel.use_kernel(kernel, dev)
    patches = list(iter_changed_tensors(delta))
    groups: list[_WidthGroup] = []
    if dev.type == "cuda":
        parts, groups = _stage_batched(patches, dev)
    else:
        parts = [
            (
                p.name,
                torch.from_numpy(np.ascontiguousarray(p.index)).to(dev),
                torch.from_numpy(np.ascontiguousarray(p.value)).to(dev),
            )
            for p in patches
        ]
    staged = StagedDelta(delta=delta, device=dev, parts=parts)
    if state is not None:
        staged.targets = _targets(state, staged)
        staged.bound_to = state
        if use_kernel and groups:
            from deltarl.weightsync import apply_kernel

            _check_bounds(patches)
            if apply_kernel.warm_up(dev, {g.values.dtype for g in groups}):
                staged.stores = _store_plan(groups, staged.targets)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return staged


def _host_concat(arrays: list[np.ndarray], dtype: np.dtype, pin: bool) -> torch.Tensor:
    """One (pinned) host tensor holding ``arrays`` back to back: copied on
    :data:`STAGE_THREADS` threads when large (numpy's copies release the GIL; a serial copy of
    a Qwen3-30B-A3B delta's 300 M indices is ~2.4 GB at one core's memory bandwidth)."""
    total = sum(int(a.size) for a in arrays)
    out = torch.empty(total, dtype=TORCH_OF_NUMPY[dtype], pin_memory=pin)
    if not total:
        return out
    dst = out.numpy()
    ends = np.cumsum([a.size for a in arrays]).tolist()

    def place(i: int) -> None:
        dst[ends[i] - arrays[i].size : ends[i]] = arrays[i]

    _for_each(place, len(arrays), total)
    return out


# staging copies and checks run on this many threads once a delta has PARALLEL_STAGE_ELEMS changes
STAGE_THREADS = max(1, min(8, os.cpu_count() or 1))
PARALLEL_STAGE_ELEMS = 1 << 23


def _for_each(fn: Callable[[int], None], n: int, elems: int) -> None:
    """``fn(0) ... fn(n - 1)``: on :data:`STAGE_THREADS` threads where they cover
    ``PARALLEL_STAGE_ELEMS`` elements or more, else here (errors raised here either way)."""
    if elems < PARALLEL_STAGE_ELEMS or n < 2:
        for i in range(n):
            fn(i)
        return
    with ThreadPoolExecutor(min(STAGE_THREADS, n)) as pool:
        list(pool.map(fn, range(n)))


def _to_device(arrays: list[np.ndarray], dev: torch.device, pin: bool) -> torch.Tensor:
    """``arrays`` (non-empty, of one dtype) back to back in one buffer on ``dev`` (an
    asynchronous copy): runs decoded into :func:`~.change_buffers.change_arrays` buffers are
    copied from there as they lie, other arrays gathered into pinned memory first."""
    dtype = arrays[0].dtype
    runs = host_runs(arrays)
    if len(runs) == 1 and runs[0][1] is not None:
        return runs[0][1].to(dev, non_blocking=True)
    total = sum(int(a.size) for a in arrays)
    out = torch.empty(total, dtype=TORCH_OF_NUMPY[dtype], device=dev)
    i = at = 0
    for count, view in runs:
        members = arrays[i : i + count]
        n = sum(int(a.size) for a in members)
        src = view if view is not None else _host_concat(members, dtype, pin)
        out[at : at + n].copy_(src, non_blocking=True)
        i, at = i + count, at + n
    return out


def _stage_batched(
    patches: list[TensorPatch], dev: torch.device, *, pin: bool = True
) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], list[_WidthGroup]]:
    """Parts of :class:`StagedDelta` as views into one index buffer and one value buffer per
    bit width on ``dev`` (asynchronous copies: synchronize before using them), and the width
    groups. Parts are ordered by bit width (first seen first), then as in ``patches``, so each
    width's indices are one slice of the index buffer, aligned with its value buffer."""
    if not patches:
        return [], []
    by_width: dict[np.dtype, list[TensorPatch]] = {}
    for p in patches:
        by_width.setdefault(np.dtype(p.value.dtype), []).append(p)
    ordered = [p for group in by_width.values() for p in group]
    index_dev = _to_device([np.asarray(p.index, np.int64) for p in ordered], dev, pin)
    parts: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    groups: list[_WidthGroup] = []
    at = 0
    for group in by_width.values():
        buf = _to_device([p.value for p in group], dev, pin)
        first, start, v = len(parts), at, 0
        for p in group:
            k = p.changed
            parts.append((p.name, index_dev[at : at + k], buf[v : v + k]))
            at += k
            v += k
        groups.append(
            _WidthGroup(first, len(parts), index_dev[start:at], buf, [p.changed for p in group])
        )
    return parts, groups


def _check_bounds(patches: Sequence[TensorPatch]) -> None:
    """Every index within its tensor: a raw store (the kernel) has no bounds check of its own,
    where ``index_copy_`` would fail."""

    def check(i: int) -> None:
        p = patches[i]
        if p.index.size and (int(p.index.min()) < 0 or int(p.index.max()) >= p.numel):
            raise CorruptDeltaError(
                f"{p.name}: indices outside the tensor's {p.numel} elements; nothing was written"
            )

    _for_each(check, len(patches), sum(p.changed for p in patches))


def _store_plan(
    groups: Sequence[_WidthGroup], targets: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per width group, the absolute address of every changed element (``target.data_ptr() +
    index * element_size``, computed on the indices' device without a host round trip) and the
    group's values. ``targets`` are the parts' flat bit views (contiguous; views into a fused
    parameter have their own data_ptr)."""
    out = []
    for g in groups:
        tgts = targets[g.first : g.end]
        es = g.values.element_size()
        for t in tgts:
            if t.dtype != g.values.dtype or not t.is_contiguous():
                raise StateMismatchError(
                    f"a target is {t.dtype} (contiguous: {t.is_contiguous()}), its values "
                    f"{g.values.dtype}: cannot store them in place"
                )
        dev = g.index.device
        bases = torch.tensor([t.data_ptr() for t in tgts], dtype=torch.int64).to(dev)
        counts = torch.tensor(g.counts, dtype=torch.int64).to(dev)
        addr = torch.repeat_interleave(bases, counts, output_size=g.index.numel())
        addr.add_(g.index * es)
        out.append((addr, g.values))
    return out


def _targets(state: Mapping[str, torch.Tensor], staged: StagedDelta) -> list[torch.Tensor]:
    check_compatible(state, staged.delta.patches)
    out = []
    for name, _, _ in staged.parts:
        t = state[name]
        if t.device != staged.device:
            raise StateMismatchError(
                f"{name}: tensor is on {t.device}, the delta is staged on {staged.device}"
            )
        if not t.is_contiguous():
            raise StateMismatchError(f"{name}: tensor is not contiguous; cannot patch it in place")
        out.append(bits_view(t))
    return out


def apply_staged(state: Mapping[str, torch.Tensor], staged: StagedDelta) -> str:
    """Scatter a staged delta into ``state`` in place. The caller has already checked the base
    (e.g. with :func:`verify_base` against trusted digests) and verifies the result afterwards
    (:func:`verify_result`); this is the part that runs while inference is paused.

    Returns how it wrote: ``"kernel"`` (one store launch per bit width; asynchronous) or
    ``"index_copy"`` (one ``index_copy_`` per changed tensor). A kernel launch that fails
    switches the kernel off for the process and falls back to ``index_copy_`` (the values are
    absolute bit patterns, so writing them again is harmless).
    """
    bound = staged.bound_to is state
    if bound and staged.stores is not None:
        from deltarl.weightsync import apply_kernel

        try:
            for addr, val in staged.stores:
                apply_kernel.launch(addr, val)
            return "kernel"
        except Exception as err:  # pragma: no cover - GPU only
            apply_kernel.switch_off(f"launch failed: {err!r}")
    targets = staged.targets if bound else None
    if targets is None:
        targets = _targets(state, staged)
    for flat, (_, idx, val) in zip(targets, staged.parts, strict=True):
        flat.index_copy_(0, idx, val)
    return "index_copy"


def verify_result(state: Mapping[str, torch.Tensor], delta: Delta) -> dict[str, str]:
    """Check every tensor of ``state`` against the delta's result digests; return the digests.

    Raises :class:`VerificationError` (the state is poisoned) on any mismatch.
    """
    digests = state_digests({n: state[n] for n in delta.patches})
    bad = [n for n, p in delta.patches.items() if digests[n] != p.result_digest]
    if bad:
        raise VerificationError(
            f"after applying version {delta.version}, {len(bad)} tensor(s) do not match the trainer's "
            f"digest, e.g. {bad[:3]}; the weights are poisoned, reload an anchor"
        )
    return digests
