"""The teacher's wire format: round trips (binary and JSON), and hostile input refused with a
:class:`WireError` naming the field, never another exception and never a large allocation."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.teacher.wire import (
    HEADER,
    HEADER_BYTES,
    MAX_TOP_K,
    RESPONSE_MAGIC,
    Limits,
    LogprobRequest,
    LogprobResponse,
    WireError,
    decode_json_request,
    decode_json_response,
    decode_request,
    decode_response,
    encode_json_request,
    encode_json_response,
    encode_request,
    encode_response,
    request_size,
    response_size,
)

LIMITS = Limits(max_sequences=64, max_tokens=4096, max_seq_len=512, max_top_k=32, vocab_size=100)


def sample_request() -> LogprobRequest:
    return LogprobRequest.build(
        [[1, 2, 3, 4], [5, 6], [7, 8, 9]], [1, 2, 2], [1.0, 0.5, 2.0], [-1, 0, 7]
    )


def sample_response() -> LogprobResponse:
    rng = np.random.default_rng(0)
    p, k = 5, 4
    ids = rng.integers(0, 100, (p, k)).astype(np.int32)
    lps = -rng.random((p, k)).astype(np.float32)
    ids[3:, 2:] = -1
    lps[3:, 2:] = -np.inf
    return LogprobResponse(
        offsets=np.array([0, 3, 3, 5], np.int32),
        top_ks=np.array([4, 0, 2], np.int32),
        sampled=-rng.random(p).astype(np.float32),
        top_ids=ids,
        top_logprobs=lps,
    )


def same_request(a: LogprobRequest, b: LogprobRequest) -> None:
    for name in ("tokens", "offsets", "prompt_lens", "temperatures", "top_ks"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def same_response(a: LogprobResponse, b: LogprobResponse) -> None:
    for i in range(a.n):
        for x, y in zip(a.sequence(i), b.sequence(i), strict=True):
            np.testing.assert_array_equal(x, y)


def test_request_round_trips() -> None:
    req = sample_request()
    data = encode_request(req)
    assert len(data) == request_size(3, 9) == HEADER_BYTES + 4 * 4 + 12 * 3 + 4 * 9
    assert data[:4] == b"DRTQ" and struct.unpack_from("<H", data, 4)[0] == 1
    same_request(decode_request(data, LIMITS), req)
    same_request(decode_json_request(encode_json_request(req), LIMITS), req)


def test_response_round_trips() -> None:
    resp = sample_response()
    data = encode_response(resp)
    assert len(data) == response_size(3, 5, 4)
    back = decode_response(data)
    same_response(back, resp)
    assert back.sequence(1)[1].shape == (0, 0)
    same_response(decode_json_response(encode_json_response(resp, "m")), resp)


def test_the_header_is_documented_layout() -> None:
    """docs/formats.md: magic, u16 version, u16 flags, 4 dtype codes, u32 N, u32 count, u32 K."""
    data = encode_response(sample_response())
    assert HEADER_BYTES == 24
    assert HEADER.unpack_from(data) == (RESPONSE_MAGIC, 1, 0, 1, 1, 2, 0, 3, 5, 4)
    body = np.frombuffer(data, "<i4", 4, HEADER_BYTES)
    assert body.tolist() == [0, 3, 3, 5]


def _with_header(data: bytes, **fields: int | bytes) -> bytes:
    names = ("magic", "version", "flags", "c0", "c1", "c2", "c3", "n", "count", "k")
    values = dict(zip(names, HEADER.unpack_from(data), strict=True)) | fields
    return HEADER.pack(*values.values()) + data[HEADER_BYTES:]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"magic": b"DRTX"}, "magic"),
        ({"magic": RESPONSE_MAGIC}, "magic"),
        ({"version": 2}, "version"),
        ({"flags": 1}, "flags"),
        ({"c2": 1}, "dtypes"),
        ({"c3": 9}, "dtypes"),
        ({"k": 1}, "reserved"),
        ({"n": 4}, "length"),
        ({"count": 8}, "length"),
        ({"count": 2**31}, "length"),
    ],
)
def test_bad_headers_are_refused(fields: dict[str, int | bytes], field: str) -> None:
    data = _with_header(encode_request(sample_request()), **fields)
    with pytest.raises(WireError) as err:
        decode_request(data, Limits(max_tokens=2**32, max_sequences=2**32))
    assert err.value.field == field and err.value.status == 422


def test_huge_counts_are_413_before_anything_is_read() -> None:
    data = _with_header(encode_request(sample_request()), n=2**32 - 1)
    with pytest.raises(WireError) as err:
        decode_request(data, LIMITS)
    assert err.value.field == "sequences" and err.value.status == 413
    data = _with_header(encode_request(sample_request()), count=2**32 - 1)
    with pytest.raises(WireError) as err:
        decode_request(data, LIMITS)
    assert err.value.field == "tokens" and err.value.status == 413


def test_every_truncation_and_extension_is_refused() -> None:
    data = encode_request(sample_request())
    for cut in range(len(data)):
        with pytest.raises(WireError):
            decode_request(data[:cut], LIMITS)
    with pytest.raises(WireError, match="length"):
        decode_request(data + b"\0\0\0\0", LIMITS)
    resp = encode_response(sample_response())
    for cut in range(len(resp)):
        with pytest.raises(WireError):
            decode_response(resp[:cut])


def _mutated(**arrays: list[int] | list[float]) -> bytes:
    req = sample_request()
    fields = {
        name: np.asarray(arrays.get(name, getattr(req, name)))
        for name in ("tokens", "offsets", "prompt_lens", "temperatures", "top_ks")
    }
    return encode_request(LogprobRequest(**fields))


@pytest.mark.parametrize(
    ("arrays", "field", "status"),
    [
        ({"offsets": [0, 4, 3, 9]}, "offsets", 422),
        ({"offsets": [1, 4, 6, 9]}, "offsets", 422),
        ({"offsets": [0, 4, 6, 8]}, "offsets", 422),
        ({"prompt_lens": [0, 2, 2]}, "sequences[0].prompt_len", 422),
        ({"prompt_lens": [1, 3, 2]}, "sequences[1].prompt_len", 422),
        ({"prompt_lens": [1, 2, -5]}, "sequences[2].prompt_len", 422),
        ({"top_ks": [-2, 0, 0]}, "sequences[0].top_k", 422),
        ({"top_ks": [0, 0, 33]}, "sequences[2].top_k", 422),
        ({"temperatures": [1.0, float("nan"), 1.0]}, "sequences[1].temperature", 422),
        ({"temperatures": [1.0, 1.0, 0.0]}, "sequences[2].temperature", 422),
        ({"temperatures": [float("inf"), 1.0, 1.0]}, "sequences[0].temperature", 422),
        ({"tokens": [1, 2, 3, 4, 5, 100, 7, 8, 9]}, "sequences[1].tokens[1]", 422),
        ({"tokens": [1, 2, 3, 4, 5, 6, 7, 8, -1]}, "sequences[2].tokens[2]", 422),
    ],
)
def test_inconsistent_arrays_name_the_field(
    arrays: dict[str, list[int] | list[float]], field: str, status: int
) -> None:
    with pytest.raises(WireError) as err:
        decode_request(_mutated(**arrays), LIMITS)
    assert err.value.field == field and err.value.status == status


def test_sequence_length_and_zero_sequences() -> None:
    long = LogprobRequest.build([list(range(50)) * 11], [1])
    with pytest.raises(WireError) as err:
        decode_request(encode_request(long), LIMITS)
    assert err.value.status == 413 and "longest sequence" in str(err.value)
    with pytest.raises(WireError, match="at least one sequence"):
        decode_request(encode_request(LogprobRequest.build([], [])), LIMITS)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{", "body"),
        (b"\xff\xfe", "body"),
        (b'{"sequences": [{"tokens": [1, 2]}]}', "sequences[0].prompt_len"),
        (b'{"sequences": [{"tokens": [1, 2], "prompt_len": 1, "extra": 1}]}', "sequences[0].extra"),
        (
            b'{"sequences": [{"tokens": [1, 2], "prompt_len": 1, "top_k": 99}]}',
            "sequences[0].top_k",
        ),
        (b'{"sequences": [{"tokens": [1, 1e400], "prompt_len": 1}]}', "sequences[0].tokens[1]"),
        (b'{"sequences": [{"tokens": [1, 99999999999], "prompt_len": 1}]}', "sequences[0].tokens"),
        (
            b'{"sequences": [{"tokens": [1, 2], "prompt_len": 1, "temperature": "NaN"}]}',
            "sequences[0].temperature",
        ),
        (b'{"sequences": []}', "sequences"),
    ],
)
def test_bad_json_requests_name_the_field(body: bytes, field: str) -> None:
    with pytest.raises(WireError) as err:
        decode_json_request(body, LIMITS)
    assert err.value.field == field, str(err.value)


@pytest.mark.parametrize(
    ("sequence", "field"),
    [
        ('{"tokens": [true, 2], "prompt_len": 1}', "sequences[0].tokens[0]"),
        ('{"tokens": [1, false], "prompt_len": 1}', "sequences[0].tokens[1]"),
        ('{"tokens": [1, 2.0], "prompt_len": 1}', "sequences[0].tokens[1]"),
        ('{"tokens": [1, "2"], "prompt_len": 1}', "sequences[0].tokens[1]"),
        ('{"tokens": [1, 2], "prompt_len": true}', "sequences[0].prompt_len"),
        ('{"tokens": [1, 2], "prompt_len": 1.0}', "sequences[0].prompt_len"),
        ('{"tokens": [1, 2], "prompt_len": 1, "top_k": 2.0}', "sequences[0].top_k"),
        ('{"tokens": [1, 2], "prompt_len": 1, "top_k": true}', "sequences[0].top_k"),
        ('{"tokens": [1, 2], "prompt_len": 1, "temperature": true}', "sequences[0].temperature"),
        ('{"tokens": [1, 2], "prompt_len": 1, "temperature": "0.5"}', "sequences[0].temperature"),
    ],
)
def test_json_numbers_are_strict(sequence: str, field: str) -> None:
    """``true`` is not token id 1, nor ``1.0`` or ``"1"``: JSON token ids, prompt lengths and
    top-k are JSON integers, temperatures JSON numbers."""
    with pytest.raises(WireError) as err:
        decode_json_request(f'{{"sequences": [{sequence}]}}'.encode(), LIMITS)
    assert err.value.field == field and err.value.status == 422, str(err.value)
    # the same with proper numbers is accepted (an integer temperature is a number)
    fine = decode_json_request(
        b'{"sequences": [{"tokens": [1, 2], "prompt_len": 1, "top_k": 2, "temperature": 1}]}',
        LIMITS,
    )
    assert fine.tokens.tolist() == [1, 2] and float(fine.temperatures[0]) == 1.0


def test_json_counts_are_bounded() -> None:
    body = encode_json_request(LogprobRequest.build([[1, 2]] * 65, [1] * 65))
    with pytest.raises(WireError) as err:
        decode_json_request(body, LIMITS)
    assert err.value.status == 413 and err.value.field == "sequences"


@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(data: bytes) -> None:
    for decode in (lambda d: decode_request(d, LIMITS), decode_response):
        with contextlib.suppress(WireError):
            decode(data)


@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(st.data())
def test_mutated_messages_decode_validly_or_are_refused(data: st.DataObject) -> None:
    raw = bytearray(encode_request(sample_request()))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    try:
        req = decode_request(bytes(raw), LIMITS)
    except WireError:
        return
    lens = np.diff(req.offsets)
    assert (req.prompt_lens >= 1).all() and (req.prompt_lens <= lens).all()
    assert ((req.tokens >= 0) & (req.tokens < 100)).all()
    assert (req.top_ks >= -1).all() and (req.top_ks <= MAX_TOP_K).all()
    assert np.isfinite(req.temperatures).all()
