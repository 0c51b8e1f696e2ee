"""An fp8 worker on CPU: a trainer with ``publish.fp8`` publishes block-fp8 versions, and
``WeightSync`` follows them into an engine holding e4m3 weights and float32 block scales in
vLLM's fused layout (dense and mixture-of-experts), mapped by the real probe; every apply is
verified against the trainer's digests of the e4m3 bytes and the scales."""

from __future__ import annotations

import os

import pytest
import torch
from fp8_engine import KV, D, FakeFp8Engine, FusedFp8Model, Q, master_weights
from fp8_states import adam_like_step, raw, same_bytes

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.engines import SamplingParams
from deltarl.rollout.sync.weights import WeightSync
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync import fp8
from deltarl.weightsync.errors import StateMismatchError
from deltarl.weightsync.proof import ProofSpec, make_challenges
from deltarl.weightsync.reader import BucketReader

PARAMS = SamplingParams(max_new_tokens=2, seed=0)


class Fp8Trainer:
    """fp32 master weights published with ``publish.fp8`` after every Adam-like step."""

    def __init__(self, bucket: LocalBucket, lr: float = 3e-4) -> None:
        settings = PublishSettings(fp8=True, background=False, anchor_every=0)
        self.pub = WeightPublisher(bucket, settings)
        self.master = master_weights()
        self.lr = lr
        self.states: list[dict[str, torch.Tensor]] = []
        self.step()

    def step(self) -> int:
        if self.states:
            adam_like_step(self.master, self.lr, seed=len(self.states))
        v = self.pub.publish(self.master)
        bf16 = {n: t.to(torch.bfloat16) for n, t in self.master.items()}
        self.states.append(fp8.quantize_state(bf16))
        return v


def test_the_probe_maps_e4m3_weights_and_scales_onto_fused_parameters() -> None:
    model = FusedFp8Model()
    before = {n: raw(p).clone() for n, p in model.named_parameters()}
    engine = FakeFp8Engine(model)
    views = engine.named_parameters()
    assert all(torch.equal(raw(p), before[n]) for n, p in model.named_parameters())  # no write
    for spec in engine.specs:
        assert str(views[spec.name].dtype) == f"torch.{spec.dtype}"
        assert tuple(views[spec.name].shape) == spec.shape
    qkv = model.get_parameter("model.layers.1.self_attn.qkv_proj.weight")
    qkv_s = model.get_parameter("model.layers.1.self_attn.qkv_proj.weight_scale_inv")
    k = views["model.layers.1.self_attn.k_proj.weight"]
    k_s = views["model.layers.1.self_attn.k_proj.weight_scale_inv"]
    assert k.dtype == torch.float8_e4m3fn and k.data_ptr() == qkv.data_ptr() + Q * D
    assert k_s.dtype == torch.float32 and tuple(k_s.shape) == (KV // 128, D // 128)
    assert k_s.data_ptr() == qkv_s.data_ptr() + (Q // 128) * (D // 128) * 4
    w13_s = views["model.layers.1.mlp.experts.gate_up_proj_scale_inv"]
    assert tuple(w13_s.shape) == (4, 2, 2)
    assert views["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # the router


@pytest.mark.slow
@pytest.mark.parametrize("host_mirror", [False, True])
def test_a_worker_follows_fp8_versions_bit_exactly(bucket: LocalBucket, host_mirror: bool) -> None:
    trainer = Fp8Trainer(bucket)
    engine = FakeFp8Engine()
    sync = WeightSync(engine, BucketReader(bucket), host_mirror=host_mirror)
    report = sync.sync_to()
    assert [s.kind for s in report.steps] == ["anchor"]
    assert same_bytes(dict(engine.named_parameters()), trainer.states[0])
    for _ in range(3):
        v = trainer.step()
        report = sync.sync_to()
        (step,) = report.steps
        assert step.kind == "delta" and report.version == v and step.changed
        assert same_bytes(dict(engine.named_parameters()), trainer.states[v])
    assert any(s.chained for s in sync.timings)  # fp8 deltas chained on the previous one
    # the fused runtime tensors hold the trainer's q, k, v bytes and their scales, in order
    new = trainer.states[-1]
    pre = "model.layers.0.self_attn"
    fused = engine.model.get_parameter(f"{pre}.qkv_proj.weight")
    expect = torch.cat([new[f"{pre}.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(raw(fused), raw(expect))
    fused_s = engine.model.get_parameter(f"{pre}.qkv_proj.weight_scale_inv")
    expect_s = torch.cat([new[f"{pre}.{x}_proj.weight_scale_inv"] for x in "qkv"])
    assert torch.equal(raw(fused_s), raw(expect_s))
    out = sync.generate([[1, 2, 3]], PARAMS)
    assert sync.check(out[0]) == "verified" and out[0].version_max == 3
    # a weight challenge is answered from the e4m3 bytes and scales the engine serves
    spec = ProofSpec(chunk_bytes=512, chunks=64)
    pairs = make_challenges(trainer.states[3], 3, spec, 2)
    for nonce, answer in pairs:
        assert sync.prove(3, bytes.fromhex(nonce), spec) == answer


def test_a_damaged_scale_fails_verification_and_is_repaired(bucket: LocalBucket) -> None:
    """Digests cover the scales the worker serves: a scale damaged on the worker (one the next
    delta does not change) fails that delta: its decode, where the damaged element moved the
    positions of its context, or else its verification (``full_verify`` re-hashes every tensor);
    and the sync goes around it: the anchor again, then the delta."""
    trainer = Fp8Trainer(bucket)
    engine = FakeFp8Engine()
    sync = WeightSync(engine, BucketReader(bucket), full_verify=True)
    sync.sync_to()
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    engine.model.get_parameter(name).data[0, 0] *= 2
    trainer.step()
    report = sync.sync_to()
    failure = report.failures[0]
    assert report.fell_back and name in failure
    assert "verification" in failure or "positions do not decode consistently" in failure
    assert [s.kind for s in report.steps][-2:] == ["anchor", "delta"]
    assert report.version == 1 and sync.healthy
    assert same_bytes(dict(engine.named_parameters()), trainer.states[1])


def test_a_bf16_engine_refuses_an_fp8_bucket(bucket: LocalBucket) -> None:
    Fp8Trainer(bucket)

    class Bf16Engine(FakeFp8Engine):
        def __init__(self) -> None:
            self.steps = 1
            self.views = {n: t.to(torch.bfloat16) for n, t in master_weights().items()}

    sync = WeightSync(Bf16Engine(), BucketReader(bucket), max_attempts=1)
    with pytest.raises(StateMismatchError, match="block fp8"):
        sync.sync_to()

    class Blocks64Engine(FakeFp8Engine):  # fp8 in 64 x 64 blocks, the bucket in 128 x 128
        def __init__(self) -> None:
            self.steps = 1
            bf16 = {n: (torch.bfloat16, tuple(t.shape)) for n, t in master_weights().items()}
            layout = fp8.fp8_layout(bf16, (64, 64))
            self.views = {n: torch.zeros(shape, dtype=d) for n, (d, shape) in layout.items()}

    sync = WeightSync(Blocks64Engine(), BucketReader(bucket), max_attempts=1)
    with pytest.raises(StateMismatchError, match="different scale shapes: the same fp8_block"):
        sync.sync_to()


def test_vllm_block_fp8_is_supported_only_where_it_keeps_the_checkpoints_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from deltarl.rollout.engines.vllm_transfer import (
        FP8_ENVIRONMENT,
        check_supported,
        set_fp8_environment,
    )

    def config(quantization: str | None, qc: dict | None) -> SimpleNamespace:
        return SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
            model_config=SimpleNamespace(
                quantization=quantization, hf_config=SimpleNamespace(quantization_config=qc)
            ),
        )

    block = fp8.quantization_config()
    for k in FP8_ENVIRONMENT:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", "SomeOtherKernel")
    set_fp8_environment()  # what an fp8 engine does before vLLM starts
    assert os.environ["VLLM_DISABLED_KERNELS"] == "SomeOtherKernel,MarlinFP8ScaledMMLinearKernel"
    check_supported(config("fp8", block))
    check_supported(config("fp8", fp8.quantization_config(block=(64, 64))))
    for quantization, qc, why in (
        ("fp8", None, ""),  # per-tensor fp8: vLLM requantizes fused shards, transposes weights
        ("fp8", {**block, "weight_block_size": [1, 128]}, r"\[1, 128\]: deltarl quantizes"),
        ("fp8", {**block, "weight_block_size": [32, 32]}, r"\[64, 64\] or \[128, 128\]"),
        ("awq", block, ""),
    ):
        with pytest.raises(ValueError, match=f"unquantized weights or block fp8.*{why}"):
            check_supported(config(quantization, qc))
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", "SomeOtherKernel")
    with pytest.raises(ValueError, match="MarlinFP8ScaledMMLinearKernel in VLLM_DISABLED"):
        check_supported(config("fp8", block))
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM")
    with pytest.raises(ValueError, match="VLLM_USE_DEEP_GEMM=0"):
        check_supported(config("fp8", block))
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")  # asked for explicitly: refused, not changed
    with pytest.raises(ValueError, match="sets it to '1'"):
        set_fp8_environment()
    assert os.environ["VLLM_USE_DEEP_GEMM"] == "1"


def test_hf_specs_of_a_block_fp8_checkpoint_are_the_fp8_layout(tmp_path) -> None:
    import json

    import transformers

    from deltarl.rollout.engines.vllm_engine import hf_specs

    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    cfg.save_pretrained(tmp_path)
    plain = {s.name: s for s in hf_specs(str(tmp_path), "bfloat16")}
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = fp8.quantization_config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    specs = {s.name: s for s in hf_specs(str(tmp_path), "bfloat16")}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert plain[q].dtype == "bfloat16" and specs[q].dtype == "float8_e4m3fn"
    assert specs[q + "_scale_inv"].shape == (2, 2) and specs[q + "_scale_inv"].dtype == "float32"
    assert specs["model.embed_tokens.weight"] == plain["model.embed_tokens.weight"]
    quantized = [n for n, sp in plain.items() if fp8.is_quantized(n, sp.shape)]
    assert quantized and len(specs) == len(plain) + len(quantized)  # a scale for each


@pytest.mark.slow
def test_fp8_deltas_decode_in_the_decoding_child(
    bucket: LocalBucket, caplog: pytest.LogCaptureFixture
) -> None:
    """The shared-memory host mirror and the child's decoder carry e4m3 tensors too."""
    trainer = Fp8Trainer(bucket)
    engine = FakeFp8Engine()
    sync = WeightSync(engine, BucketReader(bucket), host_mirror=True, decode_process=True)
    try:
        sync.sync_to()
        for _ in range(2):
            v = trainer.step()
            report = sync.sync_to()
            assert report.version == v and [s.kind for s in report.steps] == ["delta"]
            assert same_bytes(dict(engine.named_parameters()), trainer.states[v])
        assert sync._shared is not None  # the mirror lives in shared memory
        assert "decoding here" not in caplog.text and "in process" not in caplog.text
    finally:
        sync.close()


def test_fp8_deltas_cross_vllms_update_weights_route() -> None:
    """The backend's wire message (int8 patterns of e4m3 bytes) applied by ``DeltaReceiver``
    inside a vLLM-shaped fp8 model, as ``update_weights`` would."""
    from deltarl.rollout.engines.vllm_transfer import DeltaReceiver, decode_message, encode_message
    from deltarl.weightsync.delta import compute_delta
    from deltarl.weightsync.digest import state_digest

    master = master_weights()
    v0 = fp8.quantize_state({n: t.to(torch.bfloat16) for n, t in master.items()})
    v1 = fp8.quantize_state(adam_like_step(master, 3e-4, seed=1))
    receiver = DeltaReceiver(FusedFp8Model(), torch.device("cpu"))
    engine = FakeFp8Engine()
    views = receiver.bind(engine.specs)
    with torch.no_grad():
        for name, t in views.items():
            t.copy_(v0[name])
    delta = compute_delta(v0, v1, 0, 1)
    message = encode_message(delta)
    assert str(decode_message(message).patches[W8].value.dtype) == "int8"
    report = receiver.apply(message)
    assert report.verified and report.state_digest == state_digest(v1)
    assert same_bytes(views, v1)


W8 = "model.layers.0.mlp.down_proj.weight"
