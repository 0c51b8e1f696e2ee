"""TRL-compatible sparse safetensors deltas: round trips, TRL-written files, corruption."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from deltarl.weightsync import (
    BaseMismatchError,
    CorruptDeltaError,
    DeltaError,
    StateMismatchError,
    apply_delta,
    compute_delta,
)
from deltarl.weightsync.codec.trl_format import (
    TensorSpec,
    decode_trl,
    encode_trl,
    gap_decode,
    gap_encode,
    trl_metadata,
    with_local_digests,
)

SPECIALS = {
    torch.bfloat16: [
        0x7FC1,
        -128,
        0x7F80,
        -32768,
        0x0001,
        0x7FFF,
    ],  # NaN payload, -Inf, Inf, -0.0, ...
    torch.float16: [0x7E01, -1024, 0x7C00, -32768, 0x0001, 0x7FFF],
    torch.float32: [0x7FC00001, -8388608, 0x7F800000, -(2**31), 1, 0x7FFFFFFF],
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _state(gen: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return {
        "model.embed.weight": torch.randn(64, 48, generator=gen).to(dtype),
        "model.layers.0.mlp.weight": torch.randn(3, 70_000, generator=gen).to(
            dtype
        ),  # gaps > 65535
        "model.norm.weight": torch.randn(48, generator=gen).to(dtype),
        "scalar": torch.randn((), generator=gen).to(dtype),
    }


def _perturb(
    state: dict[str, torch.Tensor], density: float, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """New state: a random fraction of elements moved by one ULP, plus special bit patterns."""
    new = {}
    for name, t in state.items():
        b = _bits(t).clone().view(-1)
        mask = torch.rand(b.numel(), generator=gen) < density
        b[mask] += 1
        if density > 0 and b.numel() >= 6:
            pos = torch.randperm(b.numel(), generator=gen)[:6]
            b[pos] = torch.tensor(SPECIALS[t.dtype], dtype=b.dtype)
        new[name] = b.view(t.dtype).reshape(t.shape)
    return new


def _equal_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("enc", ["raw", "gap_delta"])
def test_round_trip_bit_exact(dtype: torch.dtype, density: float, enc: str) -> None:
    gen = torch.Generator().manual_seed(1)
    old = _state(gen, dtype)
    new = _perturb(old, density, gen)
    delta = compute_delta(old, new, base_version=4, version=5)
    back = decode_trl(encode_trl(delta, enc))  # type: ignore[arg-type]
    assert (back.base_version, back.version) == (4, 5)
    assert back.digests_known
    for name, p in delta.patches.items():
        q = back.patches[name]
        assert (q.dtype, q.shape, q.base_digest, q.result_digest) == (
            p.dtype,
            p.shape,
            p.base_digest,
            p.result_digest,
        )
        np.testing.assert_array_equal(q.index, p.index)
        np.testing.assert_array_equal(q.value, p.value)
    state = {k: v.clone() for k, v in old.items()}
    apply_delta(state, back)
    assert _equal_bits(state, new)


def test_none_versions_round_trip() -> None:
    gen = torch.Generator().manual_seed(2)
    old = _state(gen)
    delta = compute_delta(old, _perturb(old, 0.01, gen))
    back = decode_trl(encode_trl(delta))
    assert (back.base_version, back.version) == (None, None)


def test_file_layout_is_trl_v3() -> None:
    gen = torch.Generator().manual_seed(3)
    old = _state(gen)
    delta = compute_delta(old, _perturb(old, 0.02, gen), base_version=10, version=11)
    data = encode_trl(delta, "gap_delta")
    tensors = st_load(data)
    assert set(tensors) == {f"{n}.{s}" for n in old for s in ("idx", "val")}
    assert tensors["model.layers.0.mlp.weight.idx"].dtype in (torch.uint16, torch.uint32)
    assert tensors["model.embed.weight.idx"].dtype == torch.uint16
    assert all(tensors[f"{n}.val"].dtype == torch.bfloat16 for n in old)
    meta = trl_metadata(data)
    assert meta["format"] == "sparse_weight_patch" and meta["sparse"] == "True"
    assert meta["encoding"] == "gap_delta" and meta["model_version"] == "11"
    assert int(meta["total_changed_elements"]) == delta.changed
    assert int(meta["total_elements"]) == delta.numel
    raw = st_load(encode_trl(delta, "raw"))
    assert raw["model.embed.weight.idx"].dtype == torch.int32


def test_gap_codec_width_per_param() -> None:
    small = np.array([0, 1, 5, 65_535 + 6], np.int64)  # largest gap 65535 fits uint16
    assert gap_encode(small).dtype == np.uint16
    big = np.array([3, 65_540], np.int64)
    assert gap_encode(big).dtype == np.uint32
    for idx in (small, big, np.zeros(0, np.int64), np.array([0], np.int64)):
        np.testing.assert_array_equal(gap_decode(gap_encode(idx)), idx)
    np.testing.assert_array_equal(gap_encode(np.array([2, 3, 7])), [2, 0, 3])  # idx[-1] = -1
    with pytest.raises(ValueError, match="increasing"):
        gap_encode(np.array([3, 3]))


def _trl_patch_the_trl_way(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], encoding: str, model_version: int
) -> bytes:
    """A patch built the way TRL's encode_patch builds it: torch ops, bf16 values, its metadata."""
    tensors: dict[str, torch.Tensor] = {}
    changed = total = 0
    for name in new:
        idx = (
            (old[name].reshape(-1) != new[name].reshape(-1))
            .nonzero(as_tuple=True)[0]
            .to(torch.int32)
        )
        vals = new[name].reshape(-1).index_select(0, idx.long()).to(torch.bfloat16)
        if encoding == "raw":
            enc_idx = idx
        elif idx.numel() == 0:
            enc_idx = idx.to(torch.uint16)
        else:
            i64 = idx.long()
            gaps = i64 - torch.cat([i64.new_full((1,), -1), i64[:-1]]) - 1
            enc_idx = gaps.to(torch.uint16 if int(gaps.max()) <= 0xFFFF else torch.uint32)
        tensors[f"{name}.val"] = vals.contiguous()
        tensors[f"{name}.idx"] = enc_idx.contiguous()
        changed += idx.numel()
        total += new[name].numel()
    meta = {
        "format": "sparse_weight_patch",
        "version": "1",
        "sparse": "True",
        "model_version": str(model_version),
        "num_changed_params": str(len(new)),
        "total_changed_elements": str(changed),
        "total_elements": str(total),
        "sparsity": str(1.0 - changed / total),
        "encoding": encoding,
    }
    return st_save(tensors, metadata=meta)


@pytest.mark.parametrize("enc", ["raw", "gap_delta"])
def test_reads_plain_trl_file(enc: str) -> None:
    gen = torch.Generator().manual_seed(4)
    old = _state(gen)
    new = _perturb(old, 0.01, gen)
    # NaN != NaN: TRL's float comparison flags NaN elements as changed every time; harmless
    data = _trl_patch_the_trl_way(old, new, enc, model_version=12)
    delta = decode_trl(data, like=old)
    assert not delta.digests_known
    assert (delta.base_version, delta.version) == (11, 12)

    state = {k: v.clone() for k, v in old.items()}
    with pytest.raises(DeltaError, match="no digests"):
        apply_delta(state, delta)
    assert _equal_bits(state, old)  # nothing written
    apply_delta(state, delta, check_base=False, verify=False)
    assert _equal_bits(state, new)

    # specs instead of tensors work too; local digests make it a checked delta
    specs = {n: TensorSpec.of(t) for n, t in old.items()}
    checked = with_local_digests(decode_trl(data, like=specs), old)
    assert checked.digests_known
    state = {k: v.clone() for k, v in old.items()}
    apply_delta(state, checked)
    assert _equal_bits(state, new)
    with pytest.raises(BaseMismatchError, match="applied twice"):
        apply_delta(state, checked)


def test_reads_trl_v1_layout_and_missing_params() -> None:
    gen = torch.Generator().manual_seed(5)
    old = _state(gen)
    new = dict(old)
    new["model.norm.weight"] = _perturb({"n": old["model.norm.weight"]}, 0.2, gen)["n"]
    idx = (
        (_bits(old["model.norm.weight"]) != _bits(new["model.norm.weight"]))
        .nonzero()
        .view(-1)
        .to(torch.int32)
    )
    tensors = {
        "model.norm.weight.indices": idx,
        "model.norm.weight.values": new["model.norm.weight"][idx.long()],
    }
    meta = {"format": "sparse_weight_patch", "sparse": "True", "model_version": "3",
            "changed_params": json.dumps(["model.norm.weight"])}  # fmt: skip
    delta = decode_trl(st_save(tensors, metadata=meta), like=old)
    assert delta.patches["model.embed.weight"].changed == 0
    state = {k: v.clone() for k, v in old.items()}
    apply_delta(state, delta, check_base=False, verify=False)
    assert _equal_bits(state, new)


def test_plain_trl_needs_like_and_refuses_anchor() -> None:
    gen = torch.Generator().manual_seed(6)
    old = _state(gen)
    data = _trl_patch_the_trl_way(old, _perturb(old, 0.01, gen), "raw", 2)
    with pytest.raises(DeltaError, match="like="):
        decode_trl(data)
    anchor = st_save(dict(old), metadata={"format": "sparse_weight_patch", "sparse": "False"})
    with pytest.raises(CorruptDeltaError, match="anchor"):
        decode_trl(anchor, like=old)


def _plain(tensors: dict[str, torch.Tensor], encoding: str = "raw") -> bytes:
    return st_save(
        tensors, metadata={"format": "sparse_weight_patch", "sparse": "True", "encoding": encoding}
    )


@pytest.mark.parametrize(
    ("tensors", "encoding", "match"),
    [
        ({"w.idx": torch.tensor([1, 10], dtype=torch.int32), "w.val": torch.ones(2, dtype=torch.bfloat16)}, "raw", "out of range"),
        ({"w.idx": torch.tensor([-1], dtype=torch.int32), "w.val": torch.ones(1, dtype=torch.bfloat16)}, "raw", "out of range"),
        ({"w.idx": torch.tensor([3, 2], dtype=torch.int32), "w.val": torch.ones(2, dtype=torch.bfloat16)}, "raw", "increasing"),
        ({"w.idx": torch.tensor([2, 2], dtype=torch.int32), "w.val": torch.ones(2, dtype=torch.bfloat16)}, "raw", "increasing"),
        ({"w.idx": torch.tensor([1, 2], dtype=torch.int32), "w.val": torch.ones(3, dtype=torch.bfloat16)}, "raw", "indices but values"),
        ({"w.idx": torch.tensor([4, 4], dtype=torch.uint16), "w.val": torch.ones(2, dtype=torch.bfloat16)}, "gap_delta", "out of range"),
        ({"w.idx": torch.tensor([1], dtype=torch.uint16), "w.val": torch.ones(1, dtype=torch.bfloat16)}, "raw", "must be I32"),
        ({"w.idx": torch.tensor([1], dtype=torch.int32)}, "raw", "both"),
        ({"w.idx": torch.tensor([1], dtype=torch.int32), "w.val": torch.ones(1, dtype=torch.bfloat16), "junk": torch.ones(1)}, "raw", "unexpected tensor"),
        ({"w.idx": torch.tensor([1], dtype=torch.int32), "w.val": torch.ones(1, dtype=torch.bfloat16)}, "nvcomp_cascaded", "unsupported index encoding"),
    ],
)  # fmt: skip
def test_plain_trl_malformed(tensors: dict[str, torch.Tensor], encoding: str, match: str) -> None:
    like = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    with pytest.raises(CorruptDeltaError, match=match):
        decode_trl(_plain(tensors, encoding), like=like)


def test_plain_trl_state_mismatch() -> None:
    like = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    wrong_dtype = _plain({"w.idx": torch.tensor([1], dtype=torch.int32), "w.val": torch.ones(1)})
    with pytest.raises(StateMismatchError, match="values are float32"):
        decode_trl(wrong_dtype, like=like)
    unknown = _plain(
        {
            "v.idx": torch.tensor([1], dtype=torch.int32),
            "v.val": torch.ones(1, dtype=torch.bfloat16),
        }
    )
    with pytest.raises(StateMismatchError, match="lacks"):
        decode_trl(unknown, like=like)


def _delta_bytes(enc: str = "gap_delta") -> tuple[bytes, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    old = _state(gen)
    return encode_trl(compute_delta(old, _perturb(old, 0.01, gen), 1, 2), enc), old  # type: ignore[arg-type]


@pytest.mark.parametrize("cut", [0, 5, 8, 100, -1000, -1])
def test_truncation_detected(cut: int) -> None:
    data, old = _delta_bytes()
    with pytest.raises(CorruptDeltaError):
        decode_trl(data[:cut], like=old)


def test_tampering_detected() -> None:
    data, old = _delta_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    for pos in (8 + n + 1, len(data) - 1, (8 + n + len(data)) // 2):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(CorruptDeltaError):
            decode_trl(bytes(bad), like=old)
    header = data[8 : 8 + n].decode()
    edited = header.replace('"deltarl.version":"2"', '"deltarl.version":"3"')
    assert edited != header
    with pytest.raises(CorruptDeltaError, match="checksum"):
        decode_trl(data[:8] + edited.encode() + data[8 + n :])
    with pytest.raises(CorruptDeltaError):
        decode_trl(b"\xff" * 64)


def test_like_must_match_self_describing_file() -> None:
    data, old = _delta_bytes()
    wrong = dict(old)
    wrong["model.norm.weight"] = torch.zeros(49, dtype=torch.bfloat16)
    with pytest.raises(StateMismatchError):
        decode_trl(data, like=wrong)
    decode_trl(data, like=old)


def test_encode_refuses_bad_input() -> None:
    gen = torch.Generator().manual_seed(8)
    old = _state(gen)
    delta = compute_delta(old, _perturb(old, 0.01, gen))
    with pytest.raises(ValueError, match="idx_encoding"):
        encode_trl(delta, "zstd")  # type: ignore[arg-type]
    plain = decode_trl(_trl_patch_the_trl_way(old, old, "raw", 1), like=old)
    with pytest.raises(DeltaError, match="without digests"):
        encode_trl(plain)
