"""Decoded changes in buffers laid out for staging: a delta decoded into them equals one decoded
into arrays of its own, and staging finds them back to back (one copy per buffer) or gathers
what lies elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from states import make_state, mixed_fused_state, perturb

from deltarl.weightsync import change_buffers
from deltarl.weightsync.change_buffers import change_arrays, host_runs
from deltarl.weightsync.codec.formats import decode_delta, encode_delta
from deltarl.weightsync.delta import _to_device, apply_delta, compute_delta, iter_changed_tensors
from deltarl.weightsync.errors import CorruptDeltaError


def test_arrays_lie_in_staging_order() -> None:
    """Indices of every patch in one buffer, grouped by value dtype (first seen first), values
    in one buffer per dtype; an empty patch gets arrays of its own."""
    sizes = [(3, np.int16), (0, np.int16), (2, np.int32), (4, np.int16), (1, np.int32)]
    arrays = change_arrays(sizes, pin=False)
    assert [a[0].size for a in arrays] == [3, 0, 2, 4, 1]
    assert [a[1].dtype for a in arrays] == [np.dtype(d) for _, d in sizes]
    order = [0, 3, 2, 4]  # int16 patches, then int32 ones
    runs = host_runs([arrays[i][0] for i in order])
    assert [(n, v is not None and v.numel()) for n, v in runs] == [(4, 10)]
    for members in ([0, 3], [2, 4]):
        runs = host_runs([arrays[i][1] for i in members])
        assert len(runs) == 1 and runs[0][0] == 2 and runs[0][1] is not None
    # out of order, or with a stranger between: several runs, the stranger gathered (None)
    stranger = np.arange(5, dtype=np.int64)
    runs = host_runs([arrays[3][0], arrays[0][0], stranger, arrays[2][0], arrays[4][0]])
    assert [(n, v is None) for n, v in runs] == [(1, False), (1, False), (1, True), (2, False)]


def test_views_write_through_and_keep_their_buffer_alive() -> None:
    (index, _), (index2, _) = change_arrays([(4, np.int16), (2, np.int16)], pin=False)
    index[:] = [1, 2, 3, 4]
    index2[:] = [7, 8]
    ((n, view),) = host_runs([index, index2])
    assert n == 2 and view is not None and view.tolist() == [1, 2, 3, 4, 7, 8]
    del view
    import gc

    gc.collect()
    # the arrays still hold the buffer: it stays registered and readable
    assert host_runs([index])[0][1] is not None and index.tolist() == [1, 2, 3, 4]


def test_to_device_copies_runs_and_gathers_the_rest() -> None:
    (a, _), (b, _) = change_arrays([(3, np.int16), (2, np.int16)], pin=False)
    a[:], b[:] = [1, 2, 3], [4, 5]
    loose = np.array([9, 10], np.int64)
    for arrays, want in (
        ([a, b], [1, 2, 3, 4, 5]),
        ([a, loose, b], [1, 2, 3, 9, 10, 4, 5]),
        ([loose], [9, 10]),
        ([b, a], [4, 5, 1, 2, 3]),
    ):
        out = _to_device(arrays, torch.device("cpu"), pin=False)
        assert out.tolist() == want


@pytest.mark.parametrize("positions", ["gaps", "contexts"])
def test_a_delta_decoded_into_buffers_is_the_same_delta(positions: str) -> None:
    old = mixed_fused_state(seed=4)
    old = {k: v.contiguous() for k, v in old.items()}
    new = perturb(old, 0.05)
    delta = compute_delta(old, new, 1, 2)
    data = encode_delta(delta, old, "compact", positions=positions)
    plain = decode_delta(data, old)
    pinned = decode_delta(data, old, pinned=True)
    assert list(plain.patches) == list(pinned.patches)
    for name, p in plain.patches.items():
        q = pinned.patches[name]
        np.testing.assert_array_equal(p.index, q.index)
        np.testing.assert_array_equal(p.value, q.value)
    changed = list(iter_changed_tensors(pinned))
    widths: dict[np.dtype, list] = {}
    for p in changed:
        widths.setdefault(p.value.dtype, []).append(p)
    ordered = [p for group in widths.values() for p in group]
    assert len(host_runs([p.index for p in ordered])) == 1  # one copy for every index
    for group in widths.values():
        assert len(host_runs([p.value for p in group])) == 1
    applied = {k: v.clone() for k, v in old.items()}
    apply_delta(applied, pinned)
    for name, t in new.items():
        assert torch.equal(applied[name].view(torch.uint8), t.view(torch.uint8)), name


def test_a_footer_that_lists_more_changes_than_elements_is_refused(monkeypatch) -> None:
    """The buffers are sized by the footer before any chunk is read: a count past the tensor
    is refused, not allocated."""
    from deltarl.weightsync.codec import compact

    old = make_state(seed=2)
    new = perturb(old, 0.05)
    data = encode_delta(compute_delta(old, new, 1, 2), old, "compact", positions="gaps")
    real = compact.read_footer

    def lying(buf):  # a footer whose checksums hold but whose count cannot
        footer = real(buf)
        footer["tensors"][0]["changed"] = 10**15
        return footer

    monkeypatch.setattr(compact, "read_footer", lying)
    with pytest.raises(CorruptDeltaError, match="changes of"):
        decode_delta(data, old, pinned=True)

    # a count the chunks do not reach is refused after the decode, with nothing applied
    def short(buf):
        footer = real(buf)
        footer["tensors"][0]["changed"] = int(footer["tensors"][0]["changed"]) + 1
        return footer

    monkeypatch.setattr(compact, "read_footer", short)
    with pytest.raises(CorruptDeltaError, match="footer says"):
        decode_delta(data, old, pinned=True)


def test_without_pinned_memory_the_buffers_are_pageable(monkeypatch, caplog) -> None:
    """No CUDA (or no pinned memory to be had): pageable buffers, laid out the same."""
    real_empty = torch.empty

    def no_pinning(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("no pinned memory here")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(change_buffers.torch, "empty", no_pinning)
    (a, _), (b, _) = change_arrays([(3, np.int16), (1, np.int16)])
    assert "pageable" in caplog.text
    assert len(host_runs([a, b])) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_buffers_reach_the_gpu_as_they_lie() -> None:
    (a, av), (b, bv) = change_arrays([(3, np.int16), (2, np.int16)])
    a[:], b[:], av[:], bv[:] = [1, 2, 3], [4, 5], [6, 7, 8], [9, 10]
    ((n, view),) = host_runs([a, b])
    assert n == 2 and view is not None and view.is_pinned()
    out = _to_device([a, b], torch.device("cuda"), pin=True)
    torch.cuda.synchronize()
    assert out.device.type == "cuda" and out.tolist() == [1, 2, 3, 4, 5]
