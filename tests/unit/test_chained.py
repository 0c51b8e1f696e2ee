"""Chained compact deltas: coded against the previous delta's moves, bit-exact, refused without
the right context, and smaller on momentum-like updates."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compact import decode_diffs

from deltarl.weightsync import (
    BaseMismatchError,
    ContextMismatchError,
    CorruptDeltaError,
    DeltaContext,
    apply_delta,
    compute_delta,
)
from deltarl.weightsync.codec.bits import FLOAT_FORMATS
from deltarl.weightsync.codec.compact import decode_compact, encode_compact
from deltarl.weightsync.codec.compact_chunks import cluster_keys
from deltarl.weightsync.codec.context import predict, skip_forbidden
from deltarl.weightsync.codec.entropy import diff_to_symbols, entropy_bits
from deltarl.weightsync.codec.formats import (
    decode_delta,
    describe,
    encode_delta,
    squash_chain,
)

INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def clone(state):
    return {k: v.clone() for k, v in state.items()}


def same_bits(a, b):
    return all(torch.equal(a[k].view(INT[a[k].dtype]), b[k].view(INT[b[k].dtype])) for k in a)


def chained_round_trip(s0, s1, s2, **kw):
    """Encode s1 -> s2 chained on s0 -> s1, decode it against s1 with the receiver's own
    context, apply, compare bits. Returns the chained blob's bytes."""
    d01 = compute_delta(s0, s1, 0, 1)
    sender_ctx = DeltaContext.of(d01, s0)
    d12 = compute_delta(s1, s2, 1, 2)
    blob = encode_compact(d12, s1, context=sender_ctx, **kw)
    # the receiver builds its context from what it decoded and applied
    recv = clone(s0)
    back01 = decode_compact(encode_compact(d01, s0), recv)
    recv_ctx = DeltaContext.of(back01, recv)
    assert recv_ctx.digest == sender_ctx.digest
    apply_delta(recv, back01)
    back = decode_compact(blob, recv, context=recv_ctx, threads=kw.get("threads"))
    apply_delta(recv, back)
    assert same_bits(recv, s2)
    return len(blob)


def _wrap(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    return (((x - info.min) % (1 << (8 * dtype.itemsize))) + info.min).astype(dtype)


@st.composite
def triples(draw):
    """Three consecutive states: arbitrary bit patterns (NaN, inf, subnormal, -0.0 included) or
    normal weights; moves that repeat the previous one, reverse it, or are unrelated."""
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    np_int = np.dtype(np.int16 if INT[dtype] == torch.int16 else np.int32)
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    states: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
        n = int(np.prod(shape))
        kind = draw(st.sampled_from(["normal", "raw", "special", "tiny"]))
        info = np.iinfo(np_int)
        if kind == "raw":
            o = rng.integers(info.min, info.max, size=n, endpoint=True)
        elif kind == "special":
            vals = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, 3.0, 6e4], np.float32)
            o = torch.from_numpy(rng.choice(vals, n)).to(dtype).view(INT[dtype]).numpy()
        else:
            scale = 1e-30 if kind == "tiny" else 0.02
            o = (torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * scale).to(dtype)
            o = o.view(INT[dtype]).numpy()
        o = o.astype(np.int64)
        d1 = rng.choice([-300, -40, -3, -2, -1, 1, 2, 3, 40, 2**14], n)
        m1 = rng.random(n) < draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]) | st.floats(0, 1))
        b1 = np.where(m1, o + d1, o)
        how = draw(st.sampled_from(["repeat", "reverse", "random", "scaled"]))
        d2 = {
            "repeat": d1,
            "reverse": -d1,
            "random": rng.choice([-3, -1, 1, 2, 5], n),
            "scaled": np.where(d1 > 0, 1, -1) * np.maximum(np.abs(d1) * 7 // 8, 1),
        }[how]
        m2 = rng.random(n) < draw(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 1))
        b2 = np.where(m2, b1 + d2, b1)
        for s, bits in zip(states, (o, b1, b2), strict=True):
            s[f"t{i}"] = torch.from_numpy(_wrap(bits, np_int)).view(dtype).reshape(shape)
    return states


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(triples(), st.sampled_from([7, 64, 1 << 24]), st.sampled_from(["contexts", "gaps"]))
def test_chained_round_trip_is_bit_exact(states, chunk_elems, positions):
    chained_round_trip(*states, chunk_elems=chunk_elems, threads=2, positions=positions)


def momentum_states(steps: int, n: int = 200_000, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """fp32 master weights moved by a slowly varying velocity (Adam-like), published as bf16."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    w[: n // 5] *= 1e-4  # tiny weights that move by many ULPs per step
    v = torch.randn(n, generator=g).sign() * 3e-6
    out = []
    for _ in range(steps):
        out.append({"w": w.bfloat16().reshape(400, -1), "b": w[:1000].bfloat16()})
        v = 0.9 * v + 0.1 * torch.randn(n, generator=g).sign() * 3e-6
        w = w + v
    return out


def test_chained_is_smaller_on_momentum_like_updates():
    s0, s1, s2 = momentum_states(3)
    chained = chained_round_trip(s0, s1, s2)
    standalone = len(encode_compact(compute_delta(s1, s2, 1, 2), s1))
    assert chained < 0.95 * standalone, (chained, standalone)


def test_chained_deltas_with_positions_as_gaps_round_trip():
    s0, s1, s2 = momentum_states(3, n=50_000)
    by_gaps = chained_round_trip(s0, s1, s2, positions="gaps", chunk_elems=4096)
    assert by_gaps > chained_round_trip(s0, s1, s2, chunk_elems=4096)


def test_chained_needs_its_own_context():
    s0, s1, s2, s3 = momentum_states(4)
    d01, d12, d23 = (
        compute_delta(a, b, i, i + 1) for i, (a, b) in enumerate([(s0, s1), (s1, s2), (s2, s3)])
    )
    ctx01 = DeltaContext.of(d01, s0)
    blob = encode_delta(d12, s1, "compact", context=ctx01)
    assert describe(blob)["context"]["version"] == 1
    with pytest.raises(ContextMismatchError, match="none was given"):
        decode_delta(blob, s1)
    with pytest.raises(ContextMismatchError, match="chained on delta 0 -> 1"):
        decode_delta(blob, s1, context=DeltaContext.of(d12, s1))
    # a context with the right versions but other contents is refused too (digest)
    fake = DeltaContext.build(
        0, 1, ctx01.index, {k: v + 1 for k, v in ctx01.before.items()}, ctx01.dtypes
    )
    with pytest.raises(ContextMismatchError):
        decode_delta(blob, s1, context=fake)
    # the wrong base is still refused with the right context
    with pytest.raises(BaseMismatchError):
        decode_delta(blob, s2, context=ctx01)
    # a standalone delta ignores any context
    plain = encode_delta(d23, s2)
    assert same_after(s2, decode_delta(plain, s2, context=ctx01), s3)
    with pytest.raises(ValueError, match="only the compact format"):
        encode_delta(d12, s1, "trl-gap", context=ctx01)


def same_after(state, delta, target):
    s = clone(state)
    apply_delta(s, delta)
    return same_bits(s, target)


def test_chained_corruption_is_detected():
    s0, s1, s2 = momentum_states(3, n=20_000)
    ctx = DeltaContext.of(compute_delta(s0, s1, 0, 1), s0)
    d12 = compute_delta(s1, s2, 1, 2)
    blob = encode_compact(d12, s1, context=ctx)
    for cut in [0, 9, len(blob) // 2, len(blob) - 1]:
        with pytest.raises(CorruptDeltaError):
            decode_compact(blob[:cut], s1, context=ctx)
    rng = np.random.default_rng(1)
    for pos in sorted(set(rng.integers(0, len(blob), 60).tolist())):
        bad = bytearray(blob)
        bad[pos] ^= 0x21
        try:
            back = decode_compact(bytes(bad), s1, context=ctx)
        except (CorruptDeltaError, BaseMismatchError, ContextMismatchError):
            continue
        assert same_after(s1, back, s2)


def test_squash_chain_decodes_chained_links():
    states = momentum_states(4, n=20_000)
    deltas = [compute_delta(states[i], states[i + 1], i, i + 1) for i in range(3)]
    blobs = [encode_delta(deltas[0], states[0])]
    for i in (1, 2):
        ctx = DeltaContext.of(deltas[i - 1], states[i - 1])
        blobs.append(encode_delta(deltas[i], states[i], context=ctx))
    _, blob = squash_chain(states[0], blobs)
    assert describe(blob)["context"] is None
    assert same_after(states[0], decode_delta(blob, states[0]), states[3])
    # without the context of the delta before, a chain starting with a chained link fails
    with pytest.raises(ContextMismatchError):
        squash_chain(states[1], blobs[1:])
    ctx = DeltaContext.of(deltas[0], states[0])
    _, blob2 = squash_chain(states[1], blobs[1:], context=ctx)
    assert same_after(states[1], decode_delta(blob2, states[1]), states[3])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_prediction_never_uses_special_values(dtype):
    fmt = FLOAT_FORMATS[dtype]
    t = torch.tensor(
        [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, 1.0, 1.0, 2.0, -3.0]
    ).to(fmt.torch_dtype)
    old = t.view(INT[fmt.torch_dtype]).numpy().copy()
    before = old.copy()
    # elements 6..9 moved from a normal neighbour; 0..5 "moved" from special patterns
    before[:6] = torch.tensor([1.0] * 6).to(fmt.torch_dtype).view(INT[fmt.torch_dtype]).numpy()
    before[6:] = (old[6:].astype(np.int64) - 3).astype(old.dtype)
    idx = np.arange(old.size)
    pred, _, buckets = predict(old, idx, idx, before, fmt, 14)
    assert np.array_equal(pred[:6], old[:6])  # zero, NaN, inf, subnormal: no prediction
    assert np.all(pred[6:] != old[6:]) and np.all(buckets[6:] > 0)
    # an overflowing extrapolation is not predicted either
    big = torch.tensor([3e38 if dtype != "float16" else 6e4]).to(fmt.torch_dtype)
    ob = big.view(INT[fmt.torch_dtype]).numpy().copy()
    bb = (big * 0.5).view(INT[fmt.torch_dtype]).numpy().copy()
    p, _, _ = predict(ob, np.array([0]), np.array([0]), bb, fmt, 16)
    assert p[0] == ob[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_prediction_is_the_correctly_rounded_extrapolation(dtype):
    """The compiled prediction equals a reference: exact float64 extrapolation, then round to
    nearest even at the format's precision (Python's round() is round-half-even)."""
    fmt = FLOAT_FORMATS[dtype]
    rng = np.random.default_rng(3)
    n = 20_000
    scale = {"bfloat16": 1e-3, "float16": 1e-2, "float32": 1e-3}[dtype]
    old_t = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * scale).to(fmt.torch_dtype)
    old = old_t.view(INT[fmt.torch_dtype]).numpy().copy()
    moves = rng.choice([-40, -7, -2, -1, 1, 2, 3, 9, 120], n)
    before = (old.astype(np.int64) - moves).astype(old.dtype)
    idx = np.arange(n)
    pred, forbidden, buckets = predict(old, idx, idx, before, fmt, 14)

    def as_float(bits):
        return torch.from_numpy(bits.copy()).view(fmt.torch_dtype).double().numpy()

    o, b = as_float(old), as_float(before)
    tiny = 2.0 ** (2 - 2 ** (fmt.exponent_bits - 1))  # smallest normal
    checked = 0
    for j in range(n):
        if min(abs(o[j]), abs(b[j])) < tiny or np.sign(o[j]) != np.sign(b[j]):
            assert pred[j] == old[j] or np.sign(o[j]) != np.sign(b[j])
            continue
        x = o[j] + (o[j] - b[j]) * 0.875
        m, e = math.frexp(x)
        ref = math.ldexp(round(math.ldexp(m, fmt.mantissa_bits + 1)), e - fmt.mantissa_bits - 1)
        if abs(ref) < tiny:
            assert pred[j] == old[j]  # a subnormal prediction is not made
            continue
        want = torch.tensor([ref], dtype=torch.float64).to(fmt.torch_dtype)
        assert pred[j] == want.view(INT[fmt.torch_dtype]).item(), (j, x, ref)
        checked += 1
    assert checked > n // 2
    assert (
        np.array_equal(
            forbidden, (old.astype(np.int64) - pred.astype(np.int64) + 2**15) % 2**16 - 2**15
        )
        or fmt.width == 32
    )
    assert np.all(buckets > 0)


def test_forbidden_residual_mapping_is_a_bijection():
    d = np.arange(-40, 41)
    for f in range(-20, 21):
        keep = d != f
        mapped = skip_forbidden(d[keep], np.full(keep.sum(), f))
        assert 0 not in mapped and len(set(mapped.tolist())) == keep.sum()
        # the decoder's value kernel undoes it (symbols of the mapped residuals, against 0)
        sym, extra, width = diff_to_symbols(mapped)
        back = decode_diffs(sym, extra, width, 16, forbidden=np.full(keep.sum(), f))
        assert np.array_equal(back, d[keep] & 0xFFFF)


def test_context_digest_and_size():
    s0, s1 = momentum_states(2, n=10_000)
    d = compute_delta(s0, s1, 3, 4)
    ctx = DeltaContext.of(d, s0)
    assert (ctx.base_version, ctx.version, ctx.changed) == (3, 4, d.changed)
    assert ctx.nbytes == 10 * d.changed  # int64 index + bf16 pattern
    assert DeltaContext.of(d, s0).digest == ctx.digest
    assert DeltaContext.of(d, s1).digest != ctx.digest  # other before-patterns


def test_cluster_keys_is_no_worse_than_either_extreme():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(12, 30)) * (rng.random((12, 30)) < 0.3)
    counts[counts.sum(axis=1) == 0, 0] = 1
    runs = cluster_keys(counts)
    assert runs[0].start == 0 and runs[-1].stop == 12
    assert all(a.stop == b.start for a, b in itertools.pairwise(runs))

    def cost(segs):
        return sum(
            entropy_bits(counts[s].sum(axis=0)) + 8 + 18 * (counts[s].sum(axis=0) > 0).sum()
            for s in segs
        )

    assert cost(runs) <= cost([slice(i, i + 1) for i in range(12)]) + 1e-6
    assert cost(runs) <= cost([slice(0, 12)]) + 1e-6
