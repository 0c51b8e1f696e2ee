"""Block fp8 quantization against a plain reference written here from the definition (Python
floats and numpy float32 division; no torch fp8 cast), and the rule of what stays in higher
precision."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deltarl.weightsync import fp8

# ------------------------------------------------------------------------------- reference


def ref_e4m3_byte(v: float) -> int:
    """The float8_e4m3fn byte of float ``v`` (|v| <= 448) rounded to nearest, ties to even."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    assert a <= 448.0
    if a == 0.0:
        return sign
    e = math.frexp(a)[1] - 1  # a in [2^e, 2^(e+1))
    quantum = 2.0 ** (max(e, -6) - 3)  # 3 mantissa bits; subnormals below 2^-6
    n = a / quantum  # exact: a power-of-two division
    r = round(n) * quantum  # Python's round: half to even, exact on these values
    if r == 0.0:
        return sign
    e = math.frexp(r)[1] - 1
    if e < -6:  # subnormal: field 0, mantissa in units of 2^-9
        return sign | int(r / 2.0**-9)
    mantissa = int((r / 2.0**e - 1.0) * 8)
    byte = sign | ((e + 7) << 3) | mantissa
    assert byte & 0x7F != 0x7F, "never NaN"
    return byte


def ref_quantize(
    x: np.ndarray, block: tuple[int, int] = (128, 128)
) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 bytes, float32 scales) of a 2-D float32 array, block by block, element by element."""
    rows, cols = x.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    q = np.zeros((rows, cols), np.uint8)
    scales = np.zeros((nr, nc), np.float32)
    for bi in range(nr):
        for bj in range(nc):
            r0, c0 = bi * block[0], bj * block[1]
            blk = x[r0 : r0 + block[0], c0 : c0 + block[1]]
            amax = np.float32(np.max(np.abs(blk)))
            s = np.float32(amax / np.float32(448.0))  # IEEE float32 division
            s = max(s, np.float32(2.0**-126))
            scales[bi, bj] = s
            for (i, j), v in np.ndenumerate(blk):
                quot = float(np.float32(v) / s)  # IEEE float32 division
                quot = min(max(quot, -448.0), 448.0)
                q[r0 + i, c0 + j] = ref_e4m3_byte(quot)
    return q, scales


def as_bytes(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()


# ------------------------------------------------------------------------------- tests


def test_reference_codes_known_e4m3_values() -> None:
    assert ref_e4m3_byte(448.0) == 0x7E
    assert ref_e4m3_byte(-448.0) == 0xFE
    assert ref_e4m3_byte(1.0) == 0x38
    assert ref_e4m3_byte(2.0**-9) == 0x01  # smallest subnormal
    assert ref_e4m3_byte(2.0**-6) == 0x08  # smallest normal
    assert ref_e4m3_byte(-0.0) == 0x80
    assert ref_e4m3_byte(1.0625) == 0x38  # tie between 1.0 and 1.125: even (1.0)
    assert ref_e4m3_byte(1.1875) == 0x3A  # tie between 1.125 and 1.25: even (1.25)
    assert ref_e4m3_byte(2.0**-10) == 0x00  # tie between 0 and 2^-9: even (0)
    assert ref_e4m3_byte(3 * 2.0**-10) == 0x02  # tie between 2^-9 and 2^-8: even
    assert ref_e4m3_byte(0.96875) == 0x38  # tie 0.9375 / 1.0 rounds up into the next binade


def _awkward(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Weights across magnitudes, with a zero block, a tiny block, ties and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 0.02
    x[:, :7] *= 1e3  # some large columns
    x[5, 9] = 0.0
    x[6, 9] = -0.0
    x[128:256, 0:128] = 0.0  # an all-zero block (scale floor)
    x[128:256, 128:256] = torch.randn(128, 128, generator=g) * 1e-39  # amax/448 < 2^-126
    # a block with amax exactly 448 (scale 1): exact ties of e4m3 inside it
    x[0:128, 128:256] = torch.randn(128, 128, generator=g)
    x[0, 128] = 448.0
    x[1, 128:134] = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -1.0625, 0.96875])
    return x


@pytest.mark.parametrize(
    ("rows", "cols", "dtype"),
    [(300, 260, torch.float32), (300, 260, torch.bfloat16), (256, 384, torch.float32)],
)
def test_quantization_equals_the_reference(rows: int, cols: int, dtype: torch.dtype) -> None:
    x = _awkward(rows, cols, seed=rows + cols).to(dtype)
    q, s = fp8.quantize_block_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and tuple(s.shape) == (-(-rows // 128), -(-cols // 128))
    ref_q, ref_s = ref_quantize(x.float().numpy())
    assert np.array_equal(s.numpy().view(np.uint32), ref_s.view(np.uint32))
    diff = np.flatnonzero(as_bytes(q) != ref_q)
    assert diff.size == 0, f"{diff.size} bytes differ, first at {divmod(int(diff[0]), cols)}"
    assert float(s[1, 0]) == 2.0**-126 and not as_bytes(q)[128:256, :128].any()
    assert float(s[0, 1]) == 1.0  # the block with amax 448
    assert as_bytes(q)[6, 9] == 0x80  # -0.0 keeps its sign


def test_stacked_experts_have_one_block_grid_per_expert() -> None:
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(3, 256, 200, generator=g) * 0.02).to(torch.bfloat16)
    q, s = fp8.quantize_block_fp8(w)
    assert tuple(s.shape) == (3, 2, 2)
    for e in range(3):
        ref_q, ref_s = ref_quantize(w[e].float().numpy())
        assert np.array_equal(as_bytes(q[e]), ref_q)
        assert np.array_equal(s[e].numpy(), ref_s)


def test_dequantized_weights_are_within_half_an_e4m3_step() -> None:
    x = torch.randn(260, 300) * 0.05
    q, s = fp8.quantize_block_fp8(x)
    err = (fp8.dequantize_block_fp8(q, s) - x).abs()
    # normal range: relative error <= 2^-4; below 2^-6 x scale: absolute error <= 2^-10 x scale
    bound = torch.maximum(
        x.abs() * 2.0**-4, fp8.dequantize_block_fp8(torch.ones_like(q), s) * 2.0**-10
    )
    assert bool((err <= bound * 1.0001).all())


def test_non_finite_values_are_refused() -> None:
    x = torch.zeros(4, 4)
    x[1, 1] = float("inf")
    with pytest.raises(ValueError, match="w: holds non-finite values"):
        fp8.quantize_block_fp8(x, name="w")
    x[1, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        fp8.quantize_block_fp8(x)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        fp8.quantize_block_fp8(torch.zeros(5))


def test_a_state_quantized_elsewhere_is_kept_and_checked() -> None:
    """e4m3 tensors beside their scales (quantized on a GPU, unchecked) pass quantize_state as
    they are; a non-finite scale or missing scales are refused there."""
    w = "model.layers.0.mlp.up_proj.weight"
    x = torch.randn(256, 128).to(torch.bfloat16)
    done = fp8.quantize_state({w: x})
    again = fp8.quantize_state(done)
    assert all(again[n] is t for n, t in done.items()) and again.keys() == done.keys()
    x[3, 4] = float("nan")
    q, scale = fp8.quantize_block_fp8(x, check=False)  # no wait for the device
    assert not bool(torch.isfinite(scale).all())
    with pytest.raises(ValueError, match=f"{w}: holds non-finite values"):
        fp8.quantize_state({w: q, fp8.scale_name(w): scale})
    with pytest.raises(ValueError, match="without their scales"):
        fp8.quantize_state({w: q})


@pytest.mark.parametrize(
    ("name", "shape", "quantized"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (256, 256), True),
        ("model.layers.0.mlp.gate_proj.weight", (512, 256), True),
        ("model.layers.0.mlp.down_proj.weight", (256, 512), True),
        ("model.layers.0.mlp.experts.3.up_proj.weight", (128, 256), True),
        ("model.layers.0.mlp.experts.gate_up_proj", (4, 256, 256), True),
        ("model.layers.0.mlp.experts.down_proj", (4, 256, 128), True),
        ("model.embed_tokens.weight", (1000, 256), False),
        ("lm_head.weight", (1000, 256), False),
        ("model.layers.0.mlp.gate.weight", (8, 256), False),  # MoE router
        ("model.layers.0.mlp.shared_expert_gate.weight", (1, 256), False),
        ("model.layers.0.self_attn.q_norm.weight", (64,), False),
        ("model.layers.0.input_layernorm.weight", (256,), False),
        ("model.layers.0.self_attn.q_proj.bias", (256,), False),
        ("model.layers.0.self_attn.q_proj.weight_scale_inv", (2, 2), False),
        ("transformer.h.0.ln_1.weight", (256,), False),
        ("model.layers.0.conv.weight", (4, 256, 3), False),  # 3-D, not experts
    ],
)
def test_the_high_precision_rule(name: str, shape: tuple[int, ...], quantized: bool) -> None:
    assert fp8.is_quantized(name, shape) is quantized
    assert not fp8.is_quantized(name, shape, torch.int64)


def test_state_layout_and_checkpoint_config() -> None:
    state = {
        "model.embed_tokens.weight": torch.zeros(300, 256, dtype=torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(300, 200).to(torch.bfloat16),
        "model.layers.0.mlp.gate.weight": torch.randn(8, 200).to(torch.bfloat16),
        "model.norm.weight": torch.ones(200, dtype=torch.bfloat16),
    }
    out = fp8.quantize_state(state)
    assert out["model.norm.weight"] is state["model.norm.weight"]
    layout = fp8.fp8_layout({n: (t.dtype, tuple(t.shape)) for n, t in state.items()})
    assert layout == {n: (t.dtype, tuple(t.shape)) for n, t in out.items()}
    assert layout["model.layers.0.mlp.up_proj.weight_scale_inv"] == (torch.float32, (3, 2))
    config = fp8.quantization_config(state)
    assert config["weight_block_size"] == [128, 128] and config["quant_method"] == "fp8"
    assert config["modules_to_not_convert"] == ["model.embed_tokens", "model.layers.0.mlp.gate"]
    assert fp8.fp8_bytes((300, 200)) == 300 * 200 + 4 * 6
    with pytest.raises(ValueError, match="already holds"):
        fp8.quantize_state({**state, "model.layers.0.mlp.up_proj.weight_scale_inv": torch.zeros(1)})


@pytest.mark.parametrize(("rows", "cols"), [(300, 260), (576, 320)])
def test_64_blocks_equal_the_reference(rows: int, cols: int) -> None:
    """The 64 x 64 blocks (``fp8_block = 64``) by the same rule: one scale per 64 x 64 block."""
    x = _awkward(rows, cols, seed=rows * cols).to(torch.bfloat16)
    q, s = fp8.quantize_block_fp8(x, (64, 64))
    assert tuple(s.shape) == (-(-rows // 64), -(-cols // 64))
    ref_q, ref_s = ref_quantize(x.float().numpy(), (64, 64))
    assert np.array_equal(s.numpy().view(np.uint32), ref_s.view(np.uint32))
    assert np.array_equal(as_bytes(q), ref_q)
    q128, _ = fp8.quantize_block_fp8(x)
    assert not np.array_equal(as_bytes(q128), ref_q)  # the block side matters
    layout = fp8.fp8_layout(
        {"m.layers.0.mlp.up_proj.weight": (torch.bfloat16, (rows, cols))}, (64, 64)
    )
    assert layout["m.layers.0.mlp.up_proj.weight_scale_inv"] == (torch.float32, tuple(s.shape))


def test_block_sides_and_checkpoint_configs() -> None:
    assert fp8.block_of(64) == (64, 64) and fp8.block_of(128) == fp8.BLOCK
    with pytest.raises(ValueError, match="32 x 32 blocks: deltarl quantizes to 64 x 64 or 128"):
        fp8.block_of(32)
    for side in fp8.BLOCK_SIDES:
        config = fp8.quantization_config(block=(side, side))
        assert fp8.config_block(config) == (side, side) and fp8.is_block_fp8_config(config)
    assert fp8.config_block(None) is None
    assert fp8.config_block({"quant_method": "awq", "weight_block_size": [128, 128]}) is None
    assert fp8.config_block({"quant_method": "fp8"}) is None  # per-tensor fp8
    static = {**fp8.quantization_config(), "activation_scheme": "static"}
    assert fp8.config_block(static) is None
    for bad in ([128, 64], [256, 256], ["a", 1], 128):
        with pytest.raises(ValueError, match="weight_block_size"):
            fp8.config_block({"quant_method": "fp8", "weight_block_size": bad})


@pytest.mark.parametrize(
    ("rows", "world", "side"),
    [(320, 2, 128), (300, 3, 128), (576, 4, 128), (130, 3, 128), (64, 3, 128), (300, 4, 64)],
)
def test_row_shards_quantize_like_the_whole_tensor(rows: int, world: int, side: int) -> None:
    """FSDP2 splits rows in chunks of ceil(rows / world): a 128-row block can straddle two ranks
    (or more). Each rank's partial amax grid, max-reduced, gives every rank the same scales;
    each quantizes its own rows; the owners of each block's first row publish its scale row.
    Together: bit for bit the whole tensor's quantization."""
    g = torch.Generator().manual_seed(rows + world)
    x = (torch.randn(rows, 200, generator=g) * 0.02).to(torch.bfloat16)
    x[rows // 2, 3] = 1.0  # a large value on one rank raises a block that other ranks share
    block = (side, side)
    whole_q, whole_s = fp8.quantize_block_fp8(x, block)
    chunk = -(-rows // world)
    spans = [(lo, min(lo + chunk, rows)) for lo in range(0, rows, chunk)]
    spans += [(rows, rows)] * (world - len(spans))  # ranks with no rows
    grids = [fp8.partial_amax(x[lo:hi], lo, rows, block) for lo, hi in spans]
    amax = torch.stack(grids).amax(0)  # the all-reduce MAX
    qs, owned = [], []
    for lo, hi in spans:
        q, s = fp8.quantize_rows(x[lo:hi], lo, amax, block)
        assert torch.equal(s, whole_s)
        qs.append(q)
        first, end = fp8.owned_scale_rows(lo, hi, block)
        owned += range(first, end)
    assert torch.equal(torch.cat(qs).view(torch.uint8), whole_q.view(torch.uint8))
    assert owned == list(range(whole_s.shape[0]))  # the owners tile the scale grid
