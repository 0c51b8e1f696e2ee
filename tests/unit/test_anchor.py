"""Anchors: plain-safetensors compatibility, zstd streaming, digests, corruption."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save

from deltarl.weightsync import CorruptDeltaError, state_digests
from deltarl.weightsync.anchor import (
    decode_anchor,
    encode_anchor,
    read_anchor,
    write_anchor,
)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    bf = torch.randn(33, 17, generator=gen).to(torch.bfloat16)
    bf.view(torch.int16).view(-1)[:4] = torch.tensor(
        [0x7FC1, -128, 0x7F80, -32768], dtype=torch.int16
    )
    f32 = torch.randn(1000, generator=gen)
    f32.view(torch.int32)[:3] = torch.tensor([0x7FC00001, 0x7F800000, -(2**31)], dtype=torch.int32)
    return {
        "model.embed_tokens.weight": bf,
        "model.norm.weight": torch.randn(17, generator=gen).to(torch.float16),
        "head.bias": f32,
        "empty": torch.zeros(0, 5, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "step": torch.tensor([7], dtype=torch.int64),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


@pytest.mark.parametrize("compress", [False, True])
def test_round_trip_bit_exact(compress: bool) -> None:
    state = _state()
    data = encode_anchor(state, 20, compress)
    back, version, digests = decode_anchor(data)
    assert version == 20
    assert digests == state_digests(state)
    assert _same(back, state)


def test_uncompressed_is_plain_safetensors(tmp_path: Path) -> None:
    state = _state()
    data = encode_anchor(state, 3)
    assert _same(st_load(data), state)
    path = tmp_path / "anchor.safetensors"
    write_anchor(path, state, 3)
    assert _same(load_file(str(path)), state)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert (
        meta["deltarl.version"] == "3"
        and meta["sparse"] == "False"
        and meta["model_version"] == "3"
    )
    assert json.loads(meta["deltarl.tensor_digests"]) == state_digests(state)


def test_compressed_file_streams(tmp_path: Path) -> None:
    state = {"w": torch.zeros(256, 256, dtype=torch.bfloat16), **_state()}
    path = tmp_path / "anchor.safetensors.zst"
    info = write_anchor(path, state, 9, compress=True)
    assert info.nbytes == path.stat().st_size
    assert info.nbytes < len(encode_anchor(state, 9)) // 4
    back, version, digests = read_anchor(path)
    assert version == 9 and digests == info.tensor_digests and _same(back, state)
    with open(path, "rb") as fh:  # a file object works as well as a path
        assert _same(read_anchor(fh)[0], state)


def test_digests_passed_in_are_checked_on_read() -> None:
    state = _state()
    wrong = dict(state_digests(state))
    wrong["head.bias"] = "0" * 32
    data = encode_anchor(state, 1, digests=wrong)
    with pytest.raises(CorruptDeltaError, match="do not match their digest"):
        decode_anchor(data)
    decode_anchor(data, verify=False)  # metadata alone is consistent


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("keep", [0, 3, 8, 20, 0.5, -1])
def test_truncation_detected(compress: bool, keep: float) -> None:
    data = encode_anchor(_state(), 5, compress)
    cut = int(len(data) * keep) if isinstance(keep, float) else keep
    with pytest.raises(CorruptDeltaError):
        decode_anchor(data[:cut])


@pytest.mark.parametrize("compress", [False, True])
def test_flipped_data_byte_detected(compress: bool) -> None:
    data = bytearray(encode_anchor(_state(), 5, compress))
    data[-7] ^= 0x10
    with pytest.raises(CorruptDeltaError):
        decode_anchor(bytes(data))


def test_edited_metadata_and_trailing_bytes_detected() -> None:
    data = encode_anchor(_state(), 5)
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + n].decode()
    edited = header.replace('"deltarl.version":"5"', '"deltarl.version":"6"')
    assert edited != header
    with pytest.raises(CorruptDeltaError, match="checksum"):
        decode_anchor(data[:8] + edited.encode() + data[8 + n :])
    with pytest.raises(CorruptDeltaError, match="trailing"):
        decode_anchor(data + b"\0")
    with pytest.raises(CorruptDeltaError, match="JSON"):
        decode_anchor(data[:8] + b"{" * n + data[8 + n :])
    with pytest.raises(CorruptDeltaError):
        decode_anchor(b"\x00" * 3)


def test_plain_safetensors_needs_opt_in() -> None:
    state = _state()
    plain = save(
        state, metadata={"format": "sparse_weight_patch", "sparse": "False", "model_version": "40"}
    )
    with pytest.raises(CorruptDeltaError, match="not a deltarl anchor"):
        decode_anchor(plain)
    back, version, digests = decode_anchor(plain, require_digests=False)
    assert version == 40 and _same(back, state) and digests == state_digests(state)
    _, version, _ = decode_anchor(save(state), require_digests=False)
    assert version is None


def test_bad_version_refused() -> None:
    with pytest.raises(ValueError, match="version"):
        write_anchor(io.BytesIO(), _state(), -1)
