"""The encoder's context scan computed with torch ops (:mod:`.device_scan`, what a GPU rank runs)
equals the numba scan, and an encoder fed those scans writes the same bytes as one given the
base. Run here on CPU tensors; the same ops run on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_compact_golden import _state

from deltarl.weightsync import compute_delta
from deltarl.weightsync.codec import kernels
from deltarl.weightsync.codec.bits import bits_numpy, float_format
from deltarl.weightsync.codec.compact import encode_compact
from deltarl.weightsync.codec.compact_chunks import (
    ChunkScan,
    analyse_chunk,
    analyse_scan_by_gaps,
    context_layout,
)
from deltarl.weightsync.codec.device_scan import (
    PinnedStaging,
    changes_and_scans,
    start_changes_and_scans,
    warm_up,
)
from deltarl.weightsync.delta import changed_elements

CHUNK = 997  # several chunks per tensor, the last one short


@pytest.mark.parametrize("name", ["a", "b", "c"])  # bf16, fp16 (a dense region), fp32
def test_the_scan_equals_the_numba_scan(name: str) -> None:
    old, new = _state()
    o, n = old[name], new[name]
    index, value, scans = changes_and_scans(o, n, CHUNK)
    want_index, want_value = changed_elements(o, n)
    assert np.array_equal(index, want_index) and np.array_equal(value, want_value)
    shift, emask = context_layout(float_format(o.dtype))
    bits = bits_numpy(o.contiguous())
    with_changes = sorted({int(i) // CHUNK * CHUNK for i in index})
    assert sorted(scans) == with_changes and len(with_changes) > 1
    for start, scan in scans.items():
        count = min(CHUNK, bits.size - start)
        lo, hi = np.searchsorted(index, [start, start + count])
        local = index[lo:hi] - start
        hist = np.zeros(emask + 1, np.int64)
        ctx, rank = np.empty(hi - lo, np.int64), np.empty(hi - lo, np.int64)
        kernels.scan_contexts(bits[start : start + count], local, shift, emask, hist, ctx, rank)
        assert scan.count == count
        assert np.array_equal(scan.hist, hist)
        assert np.array_equal(scan.ctx, ctx) and np.array_equal(scan.rank, rank)
        assert np.array_equal(scan.old, bits[start : start + count][local])


@pytest.mark.parametrize(
    ("positions", "ranks"), [("contexts", True), ("gaps", True), ("gaps", False)]
)
def test_an_encoder_fed_the_scans_writes_the_same_bytes(positions: str, ranks: bool) -> None:
    old, new = _state()
    delta = compute_delta(old, new, 3, 4)
    scans = {}
    for k in old:
        _, _, found = changes_and_scans(old[k], new[k], CHUNK, ranks=ranks)
        scans.update(((k, s), sc) for s, sc in found.items())
    want = encode_compact(delta, old, chunk_elems=CHUNK, threads=2, positions=positions)
    got = encode_compact(
        delta, None, chunk_elems=CHUNK, threads=2, scans=scans, positions=positions
    )
    assert got == want


def test_a_scan_without_ranks_carries_the_same_changes_and_refuses_context_ranks() -> None:
    """Scans made for positions coded as gaps skip the sorts: no histograms or ranks, the same
    changes, contexts and old values; an encoder coding positions by context rank refuses
    them."""
    old, new = _state()
    index, value, ranked = changes_and_scans(old["a"], new["a"], CHUNK)
    index2, value2, rankless = changes_and_scans(old["a"], new["a"], CHUNK, ranks=False)
    assert np.array_equal(index, index2) and np.array_equal(value, value2)
    assert sorted(ranked) == sorted(rankless)
    for start, scan in rankless.items():
        assert scan.hist is None and scan.rank is None and scan.count == ranked[start].count
        assert np.array_equal(scan.ctx, ranked[start].ctx)
        assert np.array_equal(scan.old, ranked[start].old)
    delta = compute_delta({"a": old["a"]}, {"a": new["a"]}, 3, 4)
    scans = {("a", s): sc for s, sc in rankless.items()}
    with pytest.raises(ValueError, match="no context ranks"):
        encode_compact(delta, None, chunk_elems=CHUNK, scans=scans, positions="contexts")


def _chunks(pending) -> list[tuple[int, int]]:
    return [(start, scan.count) for start, scan in sorted(pending.result()[2].items())]


@pytest.mark.parametrize("name", ["a", "b", "c"])  # bf16, fp16 (a dense region), fp32
def test_the_one_call_gap_analysis_equals_the_general_one(name: str) -> None:
    """The encoder's single compiled call for a standalone chunk coded by gaps finds what the
    general analysis finds from the same scan: positions, Rice parameter, contexts, symbols."""
    old, new = _state()
    index, value, scans = changes_and_scans(old[name], new[name], CHUNK)
    fmt = float_format(old[name].dtype)
    for start, scan in scans.items():
        lo, hi = np.searchsorted(index, [start, start + scan.count])
        want = analyse_chunk(
            name,
            start,
            None,
            index[lo:hi] - start,
            value[lo:hi],
            fmt,
            scan=scan,
            positions="gaps",
        )
        got = analyse_scan_by_gaps(name, start, index[lo:hi], value[lo:hi], fmt, scan)
        for field in ("ctx_ids", "kc", "rice_k", "gaps", "key", "counts", "symbols", "sym_ctx"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), field
        assert np.array_equal(got.extra, want.extra) and np.array_equal(got.widths, want.widths)
        assert (got.start, got.count, got.by_gaps) == (want.start, want.count, True)


def test_a_pending_scan_resolves_once_to_its_chunks() -> None:
    old, new = _state()
    n = old["a"].numel()
    pending = start_changes_and_scans(old["a"], new["a"], CHUNK)
    chunks = _chunks(pending)
    starts = [s for s, _ in chunks]
    assert starts == sorted(starts) and all(s % CHUNK == 0 for s, _ in chunks)
    assert chunks[-1][1] == min(CHUNK, n - starts[-1])
    first = pending.result()
    assert pending.result() is first  # computed once
    assert changes_and_scans(old["a"], new["a"], CHUNK)[0].tolist() == first[0].tolist()
    # a length that is a multiple of the chunk: no empty chunk after the last
    o, n2 = old["a"].view(-1)[: 2 * CHUNK], new["a"].view(-1)[: 2 * CHUNK]
    assert _chunks(start_changes_and_scans(o, n2, CHUNK)) == [(0, CHUNK), (CHUNK, CHUNK)]


def test_unchanged_and_mismatched_inputs() -> None:
    old, new = _state()
    index, value, scans = changes_and_scans(old["a"], old["a"].clone(), CHUNK)
    assert index.size == value.size == 0 and scans == {}
    with pytest.raises(ValueError, match="differ"):
        changes_and_scans(old["a"], new["b"])
    with pytest.raises(ValueError, match="positive"):
        changes_and_scans(old["a"], new["a"], 0)


@pytest.mark.parametrize("positions", ["contexts", "gaps"])
def test_the_encoder_refuses_scans_that_do_not_fit(positions: str) -> None:
    old, new = _state()
    delta = compute_delta({"a": old["a"]}, {"a": new["a"]}, 3, 4)
    _, _, found = changes_and_scans(old["a"], new["a"], CHUNK)
    scans = {("a", s): sc for s, sc in found.items()}
    with pytest.raises(ValueError, match="base state or the chunks' scans"):
        encode_compact(delta, None)
    with pytest.raises(ValueError, match="no scan of chunk"):
        encode_compact(delta, None, chunk_elems=CHUNK, scans=dict(list(scans.items())[1:]))
    with pytest.raises(ValueError, match="covers"):  # scans made with another chunk size
        encode_compact(delta, None, chunk_elems=2 * CHUNK, scans=scans)
    first = scans[("a", 0)]
    bad = {
        "hist": ChunkScan(first.count, first.hist[:-1], first.ctx, first.rank, first.old),
        "lists": ChunkScan(first.count, first.hist, first.ctx[1:], first.rank, first.old),
        "contexts": ChunkScan(
            first.count, first.hist, first.ctx + 1000, first.rank, first.old
        ),  # out of range: the kernels index with them unchecked
        "unchanged": ChunkScan(
            first.count,
            first.hist,
            first.ctx,
            first.rank,
            delta.patches["a"].value[: first.ctx.size],
        ),
    }
    says = {
        "hist": "scan histogram does not fit",
        "lists": "scan lists",
        "contexts": "scan contexts outside",
        "unchanged": "scan does not fit the delta",
    }
    for what, scan in bad.items():
        broken = {**scans, ("a", 0): scan}
        with pytest.raises(ValueError, match=says[what]):
            encode_compact(delta, None, chunk_elems=CHUNK, scans=broken, positions=positions)


def test_the_staging_hands_out_aligned_slices_until_full_and_counts_what_was_wanted() -> None:
    staging = PinnedStaging(pin=False)  # pinned memory needs a CUDA build; the bookkeeping not
    assert staging.take(10, torch.int64) is None and staging.wanted == 80  # nothing reserved
    staging.reserve(100)
    assert staging.nbytes == 64 << 20  # rounded up to 64 MiB
    staging.reserve(10)  # smaller: kept
    assert staging.nbytes == 64 << 20
    staging.reset()
    a = staging.take(3, torch.int16)
    b = staging.take(5, torch.int64)
    assert a is not None and b is not None and a.numel() == 3 and b.numel() == 5
    assert a.dtype == torch.int16 and b.dtype == torch.int64
    assert b.data_ptr() - a.data_ptr() == 64  # aligned, and after a
    a.fill_(7)
    b.fill_(-1)
    assert a.tolist() == [7, 7, 7]  # no overlap
    assert staging.take((64 << 20) // 4, torch.int32) is None  # does not fit any more
    assert staging.take(1, torch.uint8) is None  # full stays full for this version
    assert staging.wanted == 128 + (64 << 20) + 1  # everything asked for, aligned
    staging.reset()
    assert staging.wanted == 0 and staging.take(1, torch.uint8) is not None
    staging.reserve(200 << 20)
    assert staging.nbytes == 256 << 20


def test_warm_up_encodes_tiny_deltas_from_their_scans() -> None:
    warm_up()  # raises if a tiny delta does not encode from its scans


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("staged", [False, True])
def test_the_scan_on_a_gpu_equals_the_scan_on_the_cpu(staged: bool) -> None:
    old, new = _state()
    staging = PinnedStaging() if staged else None
    if staging is not None:
        staging.reserve(1)  # 64 MiB, all but 4 KiB taken: some results land there, some not
        staging.reset()
        assert staging.take((64 << 20) - 4096, torch.uint8) is not None
    for k in old:
        want = changes_and_scans(old[k], new[k], CHUNK)
        got = start_changes_and_scans(old[k].cuda(), new[k].cuda(), CHUNK, staging=staging).result()
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert sorted(got[2]) == sorted(want[2])
        for start, scan in want[2].items():
            other = got[2][start]
            assert other.count == scan.count
            for field in ("hist", "ctx", "rank", "old"):
                assert np.array_equal(getattr(other, field), getattr(scan, field)), (k, field)
