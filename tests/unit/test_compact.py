"""The compact format: bit-exact round trips at any density, integrity, refusal of a wrong base."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from states import perturb

from deltarl.weightsync import (
    BaseMismatchError,
    CorruptDeltaError,
    apply_delta,
    compute_delta,
)
from deltarl.weightsync.codec import kernels
from deltarl.weightsync.codec.compact import decode_compact, encode_compact, footer_summary
from deltarl.weightsync.codec.entropy import (
    ALPHABET,
    SMALL,
    TOP_BITS,
    diff_to_symbols,
    rice_parameter,
)

INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def clone(state):
    return {k: v.clone() for k, v in state.items()}


def round_trip(old, new, **kw):
    d = compute_delta(old, new, 0, 1)
    blob = encode_compact(d, old, **kw)
    back = decode_compact(blob, old, **{k: v for k, v in kw.items() if k == "threads"})
    s = clone(old)
    apply_delta(s, back)
    for k in old:
        assert torch.equal(s[k].view(INT[s[k].dtype]), new[k].view(INT[new[k].dtype])), k
    return d, blob


@st.composite
def states(draw):
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    itype = INT[dtype]
    n_tensors = draw(st.integers(1, 3))
    density = draw(st.sampled_from([0.0, 1.0, 0.001, 0.01, 0.3, 0.5, 0.51, 0.9]) | st.floats(0, 1))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for i in range(n_tensors):
        shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
        kind = draw(st.sampled_from(["normal", "raw", "special"]))
        n = int(np.prod(shape))
        info = np.iinfo(np.int16 if itype == torch.int16 else np.int32)
        if kind == "raw":  # arbitrary bit patterns: NaNs, infs, subnormals, -0.0
            o = rng.integers(info.min, info.max, size=n, endpoint=True)
        elif kind == "special":
            vals = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, 3.0], np.float32)
            o = torch.from_numpy(rng.choice(vals, n)).to(dtype).view(itype).numpy()
        else:
            o = (
                (torch.randn(n, generator=torch.Generator().manual_seed(seed % 1000)) * 0.02)
                .to(dtype)
                .view(itype)
                .numpy()
            )
        o = o.astype(np.int16 if itype == torch.int16 else np.int32)
        mask = rng.random(n) < density
        step = rng.choice([-300, -3, -2, -1, 1, 2, 3, 40, 2**14], n)
        if draw(st.booleans()):
            nv = o.astype(np.int64) + step
        else:
            nv = rng.integers(info.min, info.max, size=n, endpoint=True)
        nv = np.where(mask, nv, o).astype(np.int64)
        nv = ((nv - info.min) % (1 << (8 * o.itemsize))) + info.min
        nv = nv.astype(o.dtype)
        old[f"t{i}"] = torch.from_numpy(o.copy()).view(dtype).reshape(shape)
        new[f"t{i}"] = torch.from_numpy(nv).view(dtype).reshape(shape)
    return old, new


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states(), st.sampled_from([7, 64, 1 << 24]), st.sampled_from(["contexts", "gaps"]))
def test_round_trip_is_bit_exact_at_any_density(pair, chunk_elems, positions):
    old, new = pair
    round_trip(old, new, chunk_elems=chunk_elems, threads=2, positions=positions)


@pytest.mark.parametrize("positions", ["contexts", "gaps"])
def test_zero_and_full_density(state, positions):
    d, blob = round_trip(state, clone(state), positions=positions)
    assert d.changed == 0 and len(blob) < 2000
    full = {k: (v.float() * 1.5 + 0.001).to(v.dtype) for k, v in state.items()}
    d, _ = round_trip(state, full, positions=positions)
    assert d.density > 0.99


def test_positions_as_gaps_trade_bytes_for_a_decoder_that_reads_only_the_changes():
    """Optimizer-like steps change small weights more often (their ULP is smaller): coding
    positions by old-exponent rank exploits that, plain gaps do not. Both decode to the same
    delta; a chunk's header says which it is, so one object may mix them."""
    g = torch.Generator().manual_seed(0)
    old = {"w": (torch.randn(512, 512, generator=g) * 0.02).bfloat16()}
    new = {"w": (old["w"].float() + torch.randn(512, 512, generator=g) * 2e-6).bfloat16()}
    d, by_rank = round_trip(old, new, positions="contexts")
    _, by_gaps = round_trip(old, new, positions="gaps")
    assert len(by_rank) < len(by_gaps) < 2.5 * len(by_rank)  # 1.9x here, 1.3x on real steps
    with pytest.raises(ValueError, match="positions must be one of"):
        encode_compact(d, old, positions="ranks")


def test_chunking_does_not_change_the_result(state):
    new = perturb(state, 0.05)
    _d1, b1 = round_trip(state, new, chunk_elems=100)
    _d2, b2 = round_trip(state, new)
    assert b1 != b2  # differently chunked ...
    assert len(b1) < 3 * len(b2)  # ... and still compact


def test_smaller_than_raw_indices_on_optimizer_like_deltas():
    g = torch.Generator().manual_seed(0)
    big = {"w": (torch.randn(512, 512, generator=g) * 0.02).bfloat16()}
    master = big["w"].float() + torch.randn(512, 512, generator=g) * 2e-6
    new = {"w": master.bfloat16()}
    d, blob = round_trip(big, new)
    assert 0.001 < d.density < 0.1
    bits = len(blob) * 8 / d.changed
    assert bits < 12, bits  # TRL raw costs 48 bits per changed element, gap_delta 32


def test_wrong_base_is_refused_before_decoding(state):
    new = perturb(state, 0.05)
    blob = encode_compact(compute_delta(state, new, 0, 1), state)
    with pytest.raises(BaseMismatchError):
        decode_compact(blob, perturb(state, 0.01, seed=5))


@pytest.mark.parametrize("positions", ["contexts", "gaps"])
def test_decoding_against_another_base_unchecked_is_refused_by_the_positions(state, positions):
    """With the base digest check off, the positions still catch another base: by context
    rank the walk does not end where the header says, as gaps the changes per old exponent
    differ from the header's (a whole tensor decoded in one call names its chunk)."""
    new = perturb(state, 0.05)
    blob = encode_compact(compute_delta(state, new, 0, 1), state, positions=positions)
    other = {k: (v.float() * 1.7 + 0.01).to(v.dtype) for k, v in state.items()}
    with pytest.raises(CorruptDeltaError, match=r"decode consistently|beyond the tensor"):
        decode_compact(blob, other, check_base=False)


def test_every_truncation_is_detected(state):
    blob = encode_compact(compute_delta(state, perturb(state, 0.1), 0, 1), state)
    for cut in [0, 1, 7, 8, 20, len(blob) // 2, len(blob) - 25, len(blob) - 1]:
        with pytest.raises(CorruptDeltaError):
            decode_compact(blob[:cut], state)


def test_every_flipped_byte_is_detected_or_harmless(state):
    new = perturb(state, 0.1)
    blob = encode_compact(compute_delta(state, new, 0, 1), state)
    rng = np.random.default_rng(0)
    positions = sorted(set(rng.integers(0, len(blob), 150).tolist()) | {0, 8, len(blob) - 1})
    for pos in positions:
        bad = bytearray(blob)
        bad[pos] ^= 0x5A
        try:
            back = decode_compact(bytes(bad), state)
        except (CorruptDeltaError, BaseMismatchError):
            continue
        # a decode that succeeds must still reproduce the exact target (e.g. a flipped byte
        # inside zstd padding); apply_delta verifies the result digest.
        s = clone(state)
        apply_delta(s, back)
        for k in s:
            assert torch.equal(s[k].view(torch.int16), new[k].view(torch.int16))


def test_footer_summary_reads_without_decoding(state):
    d = compute_delta(state, perturb(state, 0.05), 7, 8)
    info = footer_summary(encode_compact(d, state))
    assert info["base_version"] == 7 and info["version"] == 8
    assert sum(t["changed"] for t in info["tensors"].values()) == d.changed


def test_symbol_mapping_round_trips_every_difference():
    d = np.concatenate([np.arange(-70000, 70001), [-(2**31), 2**31 - 1, 2**15, -(2**15)]]).astype(
        np.int64
    )
    d = d[d != 0]
    sym, extra, width = diff_to_symbols(d)
    assert sym.min() >= 0 and sym.max() < ALPHABET
    assert np.all(extra < (np.int64(1) << width) + (width == 0))
    assert np.array_equal(decode_diffs(sym, extra, width, bits=32), d & 0xFFFFFFFF)
    # the decoder refuses a difference wider than the elements, and extra bits that run out
    out = np.empty(sym.size, np.int64)
    ref = np.zeros(sym.size, np.int64)
    wide = kernels.decode_values(
        sym, np.zeros(1 << 20, np.uint8), ref, sym[:0], False, 16, TOP_BITS, SMALL, out
    )
    assert wide == -2
    short = kernels.decode_values(
        sym, np.zeros(8, np.uint8), ref, sym[:0], False, 32, TOP_BITS, SMALL, out
    )
    assert short == -1


def decode_diffs(
    sym: np.ndarray,
    extra: np.ndarray,
    width: np.ndarray,
    bits: int,
    ref: np.ndarray | None = None,
    forbidden: np.ndarray | None = None,
) -> np.ndarray:
    """What the decoder's value kernel makes of symbols and their extra bits (written as the
    encoder writes them) against ``ref`` (default zeros): ``ref + diff`` wrapped to ``bits``."""
    buf = np.zeros(-(-int(width.sum()) // 8) + 1, np.uint8)
    kernels.raw_bits_encode(extra, width, buf)
    out = np.empty(sym.size, np.int64)
    ref = np.zeros(sym.size, np.int64) if ref is None else ref
    chained = forbidden is not None
    used = kernels.decode_values(
        sym, buf, ref, forbidden if chained else sym[:0], chained, bits, TOP_BITS, SMALL, out
    )
    assert used == int(width.sum())
    return out


def test_rice_parameter_is_an_integer_function():
    n = np.array([100, 1000, 10, 2, 1 << 24])
    k = np.array([1, 10, 3, 1, 1])
    assert rice_parameter(n, k).tolist() == [6, 6, 1, 0, 23]


def test_composed_delta_with_elements_that_changed_back(state):
    from deltarl.weightsync import compose

    mid = perturb(state, 0.2, seed=3)
    back = {k: v.clone() for k, v in state.items()}  # every change undone, plus a few new ones
    back["head.bias"] = mid["head.bias"].clone()
    squashed = compose([compute_delta(state, mid, 0, 1), compute_delta(mid, back, 1, 2)])
    blob = encode_compact(squashed, state)
    d = decode_compact(blob, state)
    s = clone(state)
    apply_delta(s, d)
    assert all(torch.equal(s[k].view(torch.int16), back[k].view(torch.int16)) for k in s)
    assert d.changed < squashed.changed  # the no-op entries were dropped


def _decode_one_chunk(
    header: list[int], body: bytes = b"", version: int = 3
) -> tuple[np.ndarray, np.ndarray]:
    """Decode a hand-made chunk of 100 bf16 zeros (one context: exponent 0) with no tables."""
    from deltarl.weightsync.codec.bits import FLOAT_FORMATS
    from deltarl.weightsync.codec.compact_chunks import ChunkRef, decode_chunk
    from deltarl.weightsync.codec.entropy import varints

    old = np.zeros(100, np.int16)
    ref = ChunkRef("t", 0, old.size, varints(header), memoryview(body), (len(body), 0, 0))
    return decode_chunk(
        ref,
        old,
        FLOAT_FORMATS["bfloat16"],
        np.full(256, -1, np.int64),
        np.zeros((0, ALPHABET), np.int64),
        version=version,
    )


@pytest.mark.parametrize("version", [2, 3])
def test_malformed_chunk_headers_by_context_rank_are_refused(version: int) -> None:
    """A chunk header whose checksums hold (a hostile encoder) but whose counts cannot be:
    a Rice parameter past any gap a chunk holds, a complement context whose element count does
    not fit its changes, more changes than the chunk has elements. Version 3 headers start with
    2 C (by context rank), version 2 headers with C."""
    n = 1 if version == 2 else 2
    # one listed context (gap 0 -> context 0) with 3 changes, not own: 2 * 3 = 6
    for header, message in (
        ([n, 0, 6, 2 * 99 + 0], "header is malformed"),  # a Rice parameter of 99
        ([n, 0, 6, 2 * 1 + 1, 7], "header is malformed"),  # complement: 7 elements, 3 changed
        ([n, 0, 6, 2 * 1 + 1, 2], "header is malformed"),  # complement: 2 elements, 3 changed
        ([n, 0, 2 * 101, 2 * 1 + 0], "more changes than it has elements"),
    ):
        with pytest.raises(CorruptDeltaError, match=message):
            _decode_one_chunk(header, version=version)
    with pytest.raises(CorruptDeltaError, match="position stream ends early"):
        _decode_one_chunk([n, 0, 6, 2 * 1 + 0], version=version)  # only the empty body is wrong


def test_malformed_chunks_by_gaps_are_refused() -> None:
    """A chunk coded by gaps (header ``2 C + 1, rice, (context gap, 2 k + own)...``) whose
    checksums hold but whose content cannot be: a Rice parameter past any gap, a context past
    the exponents, more changes than elements, a position past the chunk, positions whose old
    exponents do not have the listed counts (another base), a stream too short."""
    three = bytes([0b11100000])  # Rice k=0: gaps 0, 0, 0 -> positions 0, 1, 2
    for header, body, message in (
        ([3, 99, 0, 6], three, "header is malformed"),  # a Rice parameter of 99
        ([3, 0, 256, 6], three, "header is malformed"),  # context 256: bf16 has 256 exponents
        ([3, 0, 0, 2 * 101], three, "more changes than it has elements"),
        ([3, 8, 0, 2], bytes([0b11100100, 0]), "beyond the tensor"),  # k=8: gap 200
        ([3, 0, 5, 6], three, "do not decode consistently"),  # exponent 5: the base has none
        ([3, 0, 0, 2 * 20], three, "position stream ends early"),  # 20 gaps in 3 bits
        ([3, 0, 0, 6], three, "frequency table the delta does not hold"),  # positions fine
    ):
        with pytest.raises(CorruptDeltaError, match=message):
            _decode_one_chunk(header, body)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 1 << 45), min_size=1, max_size=12),
    st.binary(max_size=64),
    st.sampled_from([2, 3]),
)
def test_any_chunk_a_hostile_encoder_writes_decodes_or_is_refused(header, body, version) -> None:
    """Chunk headers and bodies behind valid checksums (a hostile encoder): decoding either
    gives positions inside the chunk in order, or a CorruptDeltaError; never another error,
    never a read outside the base."""
    try:
        index, _ = _decode_one_chunk(header, body, version=version)
    except CorruptDeltaError:
        return
    assert kernels.increasing_below(index, 100)


@pytest.mark.parametrize("kmax", [0, 3, 12, 40])
def test_rice_codes_round_trip_and_a_short_stream_is_refused(kmax: int) -> None:
    rng = np.random.default_rng(kmax)
    k = rng.integers(0, kmax + 1, 5000).astype(np.uint8)
    # values around 2**k, some with long unary parts (q up to ~40 zero bits)
    v = (rng.integers(0, 1 << 20, 5000) % ((np.int64(1) << k.astype(np.int64)) * 40 + 1)).astype(
        np.int64
    )
    nbits = int(kernels.rice_bits(v, k))
    buf = np.zeros(-(-nbits // 8), np.uint8)
    assert kernels.rice_encode(v, k, buf) == nbits
    out = np.empty(v.size, np.int64)
    assert kernels.rice_decode(buf, k, out) == nbits
    assert np.array_equal(out, v)
    assert kernels.rice_decode(buf[: buf.size // 2], k, out) == -1
    assert kernels.rice_decode(buf[:0], k, out) == -1


def test_a_run_of_chunks_names_the_chunk_that_fails():
    """Chunks coded as gaps decode in runs across tensors, one compiled call a run: when one
    chunk of one tensor meets another base, the error names that tensor and chunk, on a pool
    of its own or one shared with other decodes; the right base decodes the same either way."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(7)
    old = {f"w{i}": (torch.randn(3000, generator=g) * 0.02).bfloat16() for i in range(12)}
    new = perturb(old, 0.05)
    delta = compute_delta(old, new, 0, 1)
    blob = encode_compact(delta, old, positions="gaps", chunk_elems=1000)
    other = dict(old)
    other["w7"] = old["w7"].clone()
    other["w7"][2000:] = old["w7"][2000:] * 64  # six exponents up: other change counts there
    with ThreadPoolExecutor(2) as pool:
        for kw in ({"threads": 2}, {"threads": 3}, {"pool": pool}):
            with pytest.raises(
                CorruptDeltaError, match=r"w7: the chunk at element 2000: .*wrong base"
            ):
                decode_compact(blob, other, check_base=False, **kw)
            got = decode_compact(blob, old, **kw)
            for name, p in delta.patches.items():
                np.testing.assert_array_equal(got.patches[name].index, p.index)
                np.testing.assert_array_equal(got.patches[name].value, p.value)


def _header_read(ref, compiled: bool, monkeypatch) -> object:
    """``read_header`` of a v3 standalone chunk, compiled or with the reader in Python; its
    result or the text of its CorruptDeltaError."""
    from deltarl.weightsync.codec import compact_chunks
    from deltarl.weightsync.codec.bits import FLOAT_FORMATS

    with monkeypatch.context() as m:
        if not compiled:
            m.setattr(compact_chunks, "_read_gap_header", lambda ref, n_exp: None)
        try:
            h = compact_chunks.read_header(ref, FLOAT_FORMATS["bfloat16"], False, 3)
        except CorruptDeltaError as e:
            return str(e)
    return (
        h.by_gaps,
        h.rice_k,
        *(a.tolist() for a in h.contexts),
        h.own_keys.tolist(),
        h.own_freq.tolist(),
    )


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    values=st.lists(st.integers(0, 1 << 45), min_size=1, max_size=40),
    gaps=st.booleans(),
    tail=st.binary(max_size=6),
)
def test_the_compiled_gap_header_reader_agrees_with_the_one_in_python(
    values, gaps, tail, monkeypatch
) -> None:
    """Any header (random varints, coded by gaps or not, with stray bytes after them): the
    compiled reader gives what the reader in Python gives, the same header or the same
    error. Own tables are drawn too: a table of one symbol at full frequency fits."""
    from deltarl.weightsync.codec.compact_chunks import ChunkRef
    from deltarl.weightsync.codec.entropy import varints

    values = [values[0] * 2 + int(gaps), *values[1:]]
    for extra in (b"", varints([1, 5, kernels.PROB_SCALE]), tail):
        header = varints(values) + extra
        ref = ChunkRef("t", 0, 1 << 40, header, memoryview(b""), (0, 0, 0))
        assert _header_read(ref, True, monkeypatch) == _header_read(ref, False, monkeypatch)
    # a well-formed one: two contexts, the second with a table of its own
    header = varints([2 * 2 + 1, 7, 3, 2 * 40, 10, 2 * 9 + 1, 1, 5, kernels.PROB_SCALE])
    ref = ChunkRef("t", 0, 1000, header, memoryview(b""), (0, 0, 0))
    got = _header_read(ref, True, monkeypatch)
    assert got == _header_read(ref, False, monkeypatch) and not isinstance(got, str)
