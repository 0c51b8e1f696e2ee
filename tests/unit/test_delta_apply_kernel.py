"""The paused window's store plan (weightsync/apply_kernel.py), checked on CPU.

The Triton kernel itself runs only on a GPU (tests/rollout/test_apply_kernel_gpu.py); here the
addresses it would store to are checked against ``data_ptr`` arithmetic and emulated, so that
what runs on CPU (grouping by width, address building, bounds checks, choosing the path) is
covered in CI.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from states import mixed_fused_state, perturb

from deltarl.weightsync import CorruptDeltaError, compute_delta
from deltarl.weightsync import apply_kernel as kernel_module
from deltarl.weightsync import delta as delta_module
from deltarl.weightsync.codec.bits import bits_view
from deltarl.weightsync.delta import (
    StagedDelta,
    _check_bounds,
    _host_concat,
    _stage_batched,
    _store_plan,
    _targets,
    apply_staged,
    iter_changed_tensors,
    stage_delta,
)


def _bits_equal(a, b) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def _emulate_stores(targets, stores) -> None:
    """What the kernel does, on CPU: every address must fall on exactly one element of exactly
    one target (of the value's width); that element gets the value."""
    for addr, val in stores:
        hit = torch.zeros(addr.numel(), dtype=torch.int64)
        for t in targets:
            if t.dtype != val.dtype:
                continue
            es, base = t.element_size(), t.data_ptr()
            inside = (addr >= base) & (addr < base + t.numel() * es)
            assert torch.all((addr[inside] - base) % es == 0)
            t[(addr[inside] - base) // es] = val[inside]
            hit += inside.long()
        assert torch.all(hit == 1)


def test_store_plan_addresses_are_data_ptr_arithmetic_and_bit_exact():
    state = mixed_fused_state()
    new = perturb(state, 0.1)
    delta = compute_delta(state, new, 0, 1)
    patches = list(iter_changed_tensors(delta))
    assert len(patches) > 60
    parts, groups = _stage_batched(patches, torch.device("cpu"), pin=False)
    staged = StagedDelta(delta=delta, device=torch.device("cpu"), parts=parts)
    work = _clone_keeping_views(state)  # fused views stay views into their fused copy
    targets = _targets(work, staged)
    stores = _store_plan(groups, targets)
    assert len(stores) == 2  # int16 (bf16 + fp16) and int32 (fp32)
    for g, (addr, val) in zip(groups, stores, strict=True):
        assert val is g.values and addr.dtype == torch.int64
        expect = []
        for i in range(g.first, g.end):
            name, idx, _ = parts[i]
            t = bits_view(work[name])
            expect.append(t.data_ptr() + idx * t.element_size())
        assert torch.equal(addr, torch.cat(expect))
    # views into a fused tensor: their own data_ptr, not the fused tensor's
    assert work["qkv.a"].data_ptr() == work["qkv.a"]._base.data_ptr() + 5 * 2
    _emulate_stores(targets, stores)
    assert _bits_equal(work, new)
    # and the index_copy_ path on the same staged delta agrees
    other = _clone_keeping_views(state)
    assert apply_staged(other, staged) == "index_copy"
    assert _bits_equal(other, new)


def _clone_keeping_views(state):
    bases: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        base = t._base if t._base is not None else t
        if id(base) not in bases:
            bases[id(base)] = base.clone()
        out[name] = torch.as_strided(bases[id(base)], t.shape, t.stride(), t.storage_offset())
    return out


@pytest.mark.parametrize("threaded", [False, True])
def test_bounds_are_checked_before_anything_is_stored(state, threaded, monkeypatch):
    if threaded:  # as for a large delta: the checks run on threads
        monkeypatch.setattr(delta_module, "PARALLEL_STAGE_ELEMS", 1)
    delta = compute_delta(state, perturb(state, 0.2), 0, 1)
    patches = list(iter_changed_tensors(delta))
    _check_bounds(patches)
    bad = patches[-1]
    bad.index = bad.index.copy()
    bad.index[-1] = bad.numel
    with pytest.raises(CorruptDeltaError, match="outside"):
        _check_bounds(patches)
    bad.index[-1] = -1
    with pytest.raises(CorruptDeltaError, match="outside"):
        _check_bounds([bad])


def test_large_host_concatenations_run_on_threads_and_keep_the_order(monkeypatch):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-(2**40), 2**40, int(n)) for n in rng.integers(0, 5000, 40)]
    serial = _host_concat(arrays, np.dtype(np.int64), pin=False)
    monkeypatch.setattr(delta_module, "PARALLEL_STAGE_ELEMS", 1)
    threaded = _host_concat(arrays, np.dtype(np.int64), pin=False)
    assert np.array_equal(threaded.numpy(), np.concatenate(arrays))
    assert torch.equal(serial, threaded)


def test_cpu_uses_index_copy_and_refuses_triton(state):
    new = perturb(state, 0.05)
    delta = compute_delta(state, new, 0, 1)
    s = {k: v.clone() for k, v in state.items()}
    staged = stage_delta(delta, "cpu", s)  # kernel="auto"
    assert staged.stores is None
    assert apply_staged(s, staged) == "index_copy"
    assert _bits_equal(s, new)
    with pytest.raises(ValueError, match="not CUDA"):
        stage_delta(delta, "cpu", s, kernel="triton")
    with pytest.raises(ValueError, match="kernel must be one of"):
        stage_delta(delta, "cpu", s, kernel="cuda")
    assert stage_delta(delta, "cpu", s, kernel="torch").stores is None


def test_kernel_selection(monkeypatch):
    cuda = torch.device("cuda", 0)
    cpu = torch.device("cpu")
    assert kernel_module.use_kernel("torch", cuda) is False
    assert kernel_module.use_kernel("auto", cpu) is False
    with pytest.raises(ValueError, match="one of"):
        kernel_module.use_kernel("fast", cuda)
    # no Triton: auto falls back, triton refuses
    monkeypatch.setattr(kernel_module, "triton", None)
    assert kernel_module.use_kernel("auto", cuda) is False
    with pytest.raises(ValueError, match="Triton is not installed"):
        kernel_module.use_kernel("triton", cuda)
    assert kernel_module.warm_up(cuda, {torch.int16}) is False
    # Triton present and CUDA too, but the kernel was switched off (failed warm-up or launch)
    monkeypatch.setattr(kernel_module, "triton", object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernel_module.use_kernel("auto", cuda) is True
    monkeypatch.setattr(kernel_module, "_broken", "launch failed: boom")
    assert kernel_module.use_kernel("auto", cuda) is False
    with pytest.raises(ValueError, match="switched off: launch failed"):
        kernel_module.use_kernel("triton", cuda)


def test_store_plan_refuses_a_width_mismatch(state):
    delta = compute_delta(state, perturb(state, 0.2), 0, 1)
    patches = list(iter_changed_tensors(delta))
    parts, groups = _stage_batched(patches, torch.device("cpu"), pin=False)
    targets = [bits_view(state[name]) for name, _, _ in parts]
    targets[0] = targets[0].view(torch.uint8)  # 1-byte elements under int16 values
    from deltarl.weightsync import StateMismatchError

    with pytest.raises(StateMismatchError, match="cannot store"):
        _store_plan(groups, targets)
    assert np.all([g.values.dtype == torch.int16 for g in groups])
