"""Property-based mutations of real delta files: truncated, bit-flipped, spliced,
retyped or re-nested, a delta either decodes to exactly the trainer's result or is refused with a
:class:`DeltaError` (the CLI's one-line exit 2), and the state it was applied to is untouched.
Bombs and deep nesting with their memory bound: test_compact_hostile.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from states import make_state, perturb
from support import deltarl

from deltarl.weightsync import DeltaError, apply_delta, state_digest
from deltarl.weightsync.codec.compact import TRAILER, TRAILER_MAGIC, read_footer
from deltarl.weightsync.codec.formats import decode_delta, encode_delta
from deltarl.weightsync.delta import compute_delta

OLD = make_state(seed=11)
NEW = perturb(OLD, 0.03, seed=5)
DELTA = compute_delta(OLD, NEW, 3, 4)
FILES = {fmt: encode_delta(DELTA, OLD, fmt) for fmt in ("compact", "trl-raw", "trl-gap")}
RESULT = state_digest(NEW)

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def outcome(data: bytes) -> str:
    """'result' (decoded and applied: the trainer's state) or 'refused' (a DeltaError, the
    state left as it was); anything else fails the test."""
    state = {k: v.clone() for k, v in OLD.items()}
    before = state_digest(state)
    try:
        delta = decode_delta(data, state)
        apply_delta(state, delta)
    except DeltaError:
        assert state_digest(state) == before, "a refused delta changed the state"
        return "refused"
    assert state_digest(state) == RESULT, "a delta was accepted but the result is wrong"
    return "result"


def repack_footer(data: bytes, footer: Any) -> bytes:
    return repack_raw(data, json.dumps(footer).encode())


def repack_raw(data: bytes, raw: bytes) -> bytes:
    flen, _, _ = TRAILER.unpack(data[-TRAILER.size :])
    packed = zstandard.ZstdCompressor().compress(raw)
    head = data[: len(data) - TRAILER.size - flen]
    return (
        head + packed + TRAILER.pack(len(packed), xxhash.xxh3_64_intdigest(packed), TRAILER_MAGIC)
    )


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(fmt=st.sampled_from(sorted(FILES)), cut=st.floats(0.0, 0.9999))
def test_truncated(fmt: str, cut: float) -> None:
    data = FILES[fmt]
    assert outcome(data[: int(cut * len(data))]) == "refused"


@SETTINGS
@given(fmt=st.sampled_from(sorted(FILES)), where=st.floats(0.0, 0.9999), bit=st.integers(0, 7))
def test_one_bit_flipped(fmt: str, where: float, bit: int) -> None:
    data = bytearray(FILES[fmt])
    data[int(where * len(data))] ^= 1 << bit
    got = outcome(bytes(data))  # "result" is only ever the exact trainer's state
    if fmt == "compact":
        assert got == "refused"  # every byte of a compact delta is under a checksum
    # TRL files: TRL's own metadata values (sparsity, counts, model_version) are outside the
    # deltarl checksum and unused by the decoder, so a flip there still gives the exact result


@SETTINGS
@given(
    fmt=st.sampled_from(sorted(FILES)),
    where=st.floats(0.0, 1.0),
    junk=st.binary(min_size=1, max_size=64),
    drop=st.integers(0, 64),
)
def test_spliced(fmt: str, where: float, junk: bytes, drop: int) -> None:
    data = FILES[fmt]
    i = int(where * len(data))
    got = outcome(data[:i] + junk + data[i + drop :])
    assert got == "refused" or fmt != "compact"  # TRL: see test_one_bit_flipped


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:2]):
            out += _paths(v, (*prefix, i))
    return out


FOOTER = read_footer(FILES["compact"])
FOOTER_PATHS = _paths(FOOTER)


@SETTINGS
@given(path=st.sampled_from(FOOTER_PATHS), value=JSON_VALUES)
def test_a_footer_field_retyped(path: tuple[Any, ...], value: Any) -> None:
    footer = json.loads(json.dumps(FOOTER))
    target = footer
    for key in path[:-1]:
        target = target[key]
    original = target[path[-1]]
    target[path[-1]] = value
    got = outcome(repack_footer(FILES["compact"], footer))
    if got == "result":  # the bytes decode to exactly the trainer's state (digest-checked)
        # only the version labels are not needed to decode: the weight sync checks them
        # against the manifest (tests/rollout), the CLI prints them
        assert value == original or path in (("version",), ("base_version",)), (path, value)


@SETTINGS
@given(depth=st.integers(10, 5000), where=st.sampled_from(FOOTER_PATHS))
def test_a_footer_field_nested(depth: int, where: tuple[Any, ...]) -> None:
    footer = json.loads(json.dumps(FOOTER))
    target = footer
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = "__nested__"  # written as text: json.dumps cannot nest this deep
    nested = "[" * depth + "0" + "]" * depth
    data = repack_raw(FILES["compact"], json.dumps(footer).replace('"__nested__"', nested).encode())
    assert outcome(data) == "refused"


@pytest.mark.parametrize("kind", ["truncated", "flipped", "retyped"])
def test_the_cli_answers_a_mutated_file_in_one_line_with_exit_2(tmp_path: Path, kind: str) -> None:
    data = bytearray(FILES["compact"])
    if kind == "truncated":
        data = data[: len(data) // 2]
    elif kind == "flipped":
        data[len(data) // 3] ^= 0x10
    else:
        footer = json.loads(json.dumps(FOOTER))
        footer["tensors"][0]["shape"] = "big"
        data = bytearray(repack_footer(bytes(data), footer))
    (tmp_path / "d.drl").write_bytes(bytes(data))
    save_file(OLD, str(tmp_path / "base.safetensors"))
    out = tmp_path / "out.safetensors"
    r = deltarl(
        "delta",
        "apply",
        str(tmp_path / "base.safetensors"),
        str(tmp_path / "d.drl"),
        "-o",
        str(out),
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: ") and not out.exists()  # nothing written
