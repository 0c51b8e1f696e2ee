"""fp8 versions through the weight-sync formats: the e4m3 bytes coded given the old byte, the
float32 scales, and the bf16 tensors a version keeps, in one delta or anchor; round trips at any
density, chained deltas, squash, scale changes, damaged and mismatched inputs, and the in-place
apply into e4m3 tensors viewed as bytes (as vLLM's parameters are)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fp8_states import adam_like_step, bf16_model, fp8_versions, raw, same_bytes
from safetensors.torch import load as st_load
from safetensors.torch import save_file
from states import perturb

from deltarl.weightsync import fp8
from deltarl.weightsync.anchor import decode_anchor, encode_anchor
from deltarl.weightsync.codec.compact import read_footer
from deltarl.weightsync.codec.context import DeltaContext
from deltarl.weightsync.codec.formats import (
    decode_delta,
    describe,
    encode_delta,
    squash_chain,
)
from deltarl.weightsync.delta import (
    apply_delta,
    apply_staged,
    compute_delta,
    stage_delta,
    verify_base,
    verify_result,
)
from deltarl.weightsync.digest import state_digest, tensor_digest
from deltarl.weightsync.errors import (
    BaseMismatchError,
    CorruptDeltaError,
    StateMismatchError,
)

W = "model.layers.0.mlp.up_proj.weight"  # [320, 192]: blocks 3 x 2, edge blocks on both axes


def clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


@pytest.fixture(scope="module")
def versions() -> list[dict[str, torch.Tensor]]:
    return fp8_versions(4, lr=3e-4)


def test_a_version_mixes_fp8_scales_and_bf16(versions: list[dict[str, torch.Tensor]]) -> None:
    v0 = versions[0]
    assert v0[W].dtype == torch.float8_e4m3fn
    assert v0[W + "_scale_inv"].dtype == torch.float32
    assert v0["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape == (4, 2, 2)
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert v0[kept].dtype == torch.bfloat16
    # the digest is over what a worker holds: the e4m3 bytes, typed (a uint8 copy differs)
    assert tensor_digest(v0[W]) != tensor_digest(v0[W].view(torch.uint8))


@pytest.mark.parametrize("fmt", ["compact", "trl-raw", "trl-gap"])
def test_mixed_deltas_round_trip_bit_exactly(
    versions: list[dict[str, torch.Tensor]], fmt: str
) -> None:
    old, new = versions[1], versions[2]
    delta = compute_delta(old, new, 1, 2)
    assert delta.patches[W].changed > 0 and delta.patches[W].value.dtype == np.int8
    assert delta.patches["lm_head.weight"].changed > 0
    blob = encode_delta(delta, old, fmt)
    state = clone(old)
    apply_delta(state, decode_delta(blob, old))
    assert same_bytes(state, new)
    assert state_digest(state) == delta.result_digest


@pytest.mark.parametrize("density", [0.0, 0.001, 0.3, 1.0])
def test_any_density_round_trips_nan_bytes_and_signed_zeros_included(density: float) -> None:
    old = fp8_versions(1)[0]
    new = perturb(old, density, seed=7)  # +-3 steps on every dtype's bit pattern
    new[W].view(torch.uint8).view(-1)[:5] = torch.tensor(
        [0x7F, 0xFF, 0x80, 0, 0x7E], dtype=torch.uint8
    )
    delta = compute_delta(old, new, 0, 1)
    blob = encode_delta(delta, old, "compact")
    decoded = decode_delta(blob, old)
    state = clone(old)
    apply_delta(state, decoded)
    assert same_bytes(state, new)


def test_chained_and_squashed_fp8_deltas(versions: list[dict[str, torch.Tensor]]) -> None:
    v1, v2, v3 = versions[1], versions[2], versions[3]
    d12, d23 = compute_delta(v1, v2, 1, 2), compute_delta(v2, v3, 2, 3)
    ctx = DeltaContext.of(d12, v1)
    chained = encode_delta(d23, v2, "compact", context=ctx)
    state = clone(v2)
    apply_delta(state, decode_delta(chained, v2, context=ctx))
    assert same_bytes(state, v3)
    blobs = [encode_delta(d12, v1, "compact"), encode_delta(d23, v2, "compact")]
    squashed, blob = squash_chain(v1, blobs)
    state = clone(v1)
    apply_delta(state, decode_delta(blob, v1))
    assert same_bytes(state, v3) and squashed.version == 3


def test_a_changed_scale_travels_with_the_bytes_of_its_block_that_changed() -> None:
    base = bf16_model(1)
    moved = dict(base)
    w = base[W].clone()
    # the block of rows 128-255, columns 0-127 gets a new amax: its scale changes, and every
    # byte of the block is re-expressed against the new scale; no other block is touched
    w[200, 3] = w[128:256, :128].abs().max() * 1.5
    moved[W] = w
    old, new = fp8.quantize_state(base), fp8.quantize_state(moved)
    delta = compute_delta(old, new, 0, 1)
    scales = delta.patches[W + "_scale_inv"]
    assert scales.index.tolist() == [1 * 2 + 0]  # block (1, 0) of a 3 x 2 grid
    rows, cols = np.divmod(delta.patches[W].index, 192)
    assert delta.patches[W].changed > 0.5 * 128 * 128
    assert rows.min() >= 128 and rows.max() < 256 and cols.max() < 128
    assert sum(p.changed for n, p in delta.patches.items() if not n.startswith(W)) == 0
    blob = encode_delta(delta, old, "compact")
    state = clone(old)
    apply_delta(state, decode_delta(blob, old))
    assert same_bytes(state, new)


def test_fp8_anchor_is_half_the_bf16_one_and_loads_in_safetensors(
    versions: list[dict[str, torch.Tensor]],
) -> None:
    bf16 = bf16_model(0)
    v0 = versions[0]
    for compress in (False, True):
        blob = encode_anchor(v0, 7, compress)
        state, version, digests = decode_anchor(blob)
        assert version == 7 and same_bytes(state, v0)
        assert digests == {k: tensor_digest(t) for k, t in v0.items()}
    plain = st_load(encode_anchor(v0, 7, False))
    assert plain[W].dtype == torch.float8_e4m3fn and torch.equal(raw(plain[W]), raw(v0[W]))
    quantized = sum(t.numel() for n, t in bf16.items() if fp8.is_quantized(n, t.shape, t.dtype))
    saved = len(encode_anchor(bf16, 0, False)) - len(encode_anchor(v0, 0, False))
    assert saved > 0.95 * quantized  # 1 byte a quantized element instead of 2 (+ the scales)


def test_staged_apply_writes_e4m3_bytes_into_views_of_fused_parameters(
    versions: list[dict[str, torch.Tensor]],
) -> None:
    """As in vLLM: one e4m3 parameter holds q/k (here two row blocks of one tensor) and one
    float32 parameter their scales; the worker's tensors are views into them."""
    old, new = versions[1], versions[2]
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    fused = torch.cat([old[q], old[k]])  # e4m3 [320, 192]
    fused_scales = torch.cat([old[q + "_scale_inv"], old[k + "_scale_inv"]])
    worker = clone(old)
    worker[q], worker[k] = fused[:192], fused[192:]
    worker[q + "_scale_inv"], worker[k + "_scale_inv"] = fused_scales[:2], fused_scales[2:]
    delta = compute_delta(old, new, 1, 2)
    verify_base(worker, delta)
    staged = stage_delta(delta, "cpu", worker)
    assert apply_staged(worker, staged) == "index_copy"
    verify_result(worker, delta)
    assert torch.equal(raw(fused), raw(torch.cat([new[q], new[k]])))
    assert same_bytes(worker, new)
    with pytest.raises(BaseMismatchError, match="applied twice"):
        verify_base(worker, delta)


def test_mismatched_dtypes_are_refused_before_anything_is_written(
    versions: list[dict[str, torch.Tensor]],
) -> None:
    old, new = versions[1], versions[2]
    blob = encode_delta(compute_delta(old, new, 1, 2), old, "compact")
    bf16_worker = dict(old)
    bf16_worker[W] = torch.zeros(old[W].shape, dtype=torch.bfloat16)
    with pytest.raises(StateMismatchError, match=rf"{W}: state has bfloat16\[320, 192\]"):
        decode_delta(blob, bf16_worker)
    as_bytes = dict(old)
    as_bytes[W] = old[W].view(torch.uint8)  # the same bytes, typed otherwise: another tensor
    with pytest.raises(ValueError, match="uint8"):
        decode_delta(blob, as_bytes)


def damaged(versions: list[dict[str, torch.Tensor]]) -> bytes:
    old, new = versions[1], versions[2]
    blob = bytearray(encode_delta(compute_delta(old, new, 1, 2), old, "compact"))
    describe(bytes(blob))
    blob[20] ^= 0x40  # a byte of the first chunk body
    return bytes(blob)


def test_damaged_fp8_deltas_are_refused(versions: list[dict[str, torch.Tensor]]) -> None:
    with pytest.raises(CorruptDeltaError, match="damaged"):
        decode_delta(damaged(versions), versions[1])


def test_a_footer_naming_another_fp8_dtype_is_refused(
    versions: list[dict[str, torch.Tensor]],
) -> None:
    """A footer's dtype is one of the codec's formats: float8_e5m2 (or anything else) is a
    CorruptDeltaError naming the field, not a crash."""
    from test_compact_hostile import split, with_footer

    old, new = versions[1], versions[2]
    data = encode_delta(compute_delta(old, new, 1, 2), old, "compact")
    head, footer = split(data)
    for t in footer["tensors"]:
        if t["dtype"] == "float8_e4m3fn":
            t["dtype"] = "float8_e5m2"
    with pytest.raises(CorruptDeltaError, match="dtype"):
        read_footer(with_footer(head, json.loads(json.dumps(footer))))


@pytest.mark.slow
def test_cli_applies_an_fp8_delta_and_refuses_a_damaged_one_in_one_line(
    versions: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    (tmp_path / "bad.drl").write_bytes(damaged(versions))
    out = subprocess.run(
        [sys.executable, "-m", "deltarl", "delta", "verify", str(tmp_path / "bad.drl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "damaged" in out.stderr
    old, new = versions[1], versions[2]
    save_file(old, str(tmp_path / "old.safetensors"))
    save_file(new, str(tmp_path / "new.safetensors"))
    run = [sys.executable, "-m", "deltarl", "delta"]
    enc = subprocess.run(
        [*run, "encode", str(tmp_path / "old.safetensors"), str(tmp_path / "new.safetensors"),
         "-o", str(tmp_path / "d.drl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert enc.returncode == 0, enc.stderr
    app = subprocess.run(
        [*run, "apply", str(tmp_path / "old.safetensors"), str(tmp_path / "d.drl"),
         "-o", str(tmp_path / "out.safetensors")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert app.returncode == 0, app.stderr
    from safetensors.torch import load_file

    assert same_bytes(load_file(str(tmp_path / "out.safetensors")), new)


def test_fp8_steps_change_far_fewer_elements_than_bf16() -> None:
    """The reason for fp8 versions: e4m3's step is 16x bf16's, so small updates cross it 16x
    less often (a synthetic check; bench/fp8_deltas.py measures real AdamW steps)."""
    master = {k: v.float() for k, v in bf16_model(0).items()}
    b0 = {k: v.to(torch.bfloat16) for k, v in master.items()}
    b1 = adam_like_step(master, 3e-5, 1)
    q0, q1 = fp8.quantize_state(b0), fp8.quantize_state(b1)
    names = [n for n in b0 if fp8.is_quantized(n, b0[n].shape, b0[n].dtype)]
    bf16_changed = sum(compute_delta(b0, b1).patches[n].changed for n in names)
    fp8_changed = sum(compute_delta(q0, q1).patches[n].changed for n in names)
    assert 0 < fp8_changed < bf16_changed / 4


def test_the_device_scan_finds_fp8_changes_like_the_host_encoder(
    versions: list[dict[str, torch.Tensor]],
) -> None:
    """What an FSDP rank on a GPU runs (codec/device_scan.py), here on CPU tensors: the scans
    of e4m3 and scale tensors give the same compact bytes as the encoder reading the base."""
    from deltarl.weightsync.codec.device_scan import changes_and_scans

    old, new = versions[1], versions[2]
    delta = compute_delta(old, new, 1, 2)
    scans = {}
    for name in sorted(old):
        index, value, found = changes_and_scans(old[name], new[name])
        assert np.array_equal(value, delta.patches[name].value)
        assert np.array_equal(index, delta.patches[name].index)
        scans.update(((name, start), scan) for start, scan in found.items())
    assert encode_delta(delta, None, "compact", scans=scans) == encode_delta(delta, old, "compact")
