"""Block-fp8 weights in real vLLM 0.33 on a CUDA GPU (marked ``gpu``: CI never runs them).

Run on a Hopper GPU machine with vLLM installed, in a process of its own (vLLM caches its
DeepGEMM decision per process)::

    pytest -m gpu -s tests/rollout/test_vllm_fp8_gpu.py

* A tiny Llama and a tiny Qwen3 are quantized by ``weightsync/fp8.py`` and written as
  DeepSeek-style block-fp8 checkpoints (``quantization_config`` with ``weight_block_size
  [128, 128]``), and a 2-layer model of SmolLM2-135M's widths in 64 x 64 blocks; vLLM serves
  them with ``VLLM_USE_DEEP_GEMM=0`` and Marlin's fp8 kernel disabled (CUTLASS block kernels
  for 128 x 128, Triton's for 64 x 64). Inside
  vLLM's worker the real probe (``vllm_mapping.probe_views`` on ``fp8_specs``) maps every e4m3
  weight and every float32 scale to a view of vLLM's runtime tensors, and those views hold the
  checkpoint's bytes exactly (nothing requantized or re-laid at load). Then an fp8 delta (the
  trainer's next version, quantized the same way) is staged, applied in one
  ``apply_staged`` call and verified bit-exactly, bytes and scales, by the trainer's digests;
  generation runs before and after. The logprob gap to the transformers model holding the
  dequantized weights (and holding the bf16 weights the fp8 ones came from) is printed.
* The vllm engine (``VllmEngine`` + ``WeightSync``) follows a bucket published by a
  ``WeightPublisher`` with ``publish.fp8``: anchor, then three deltas, each verified, at TP=1
  and (two GPUs) TP=2; and in 64 x 64 blocks from a bf16 model's config with the engine's
  ``fp8_block`` (the path of fp8 workers in a run); the paused apply is printed.
* The one-launch store kernel writes e4m3 bytes (8-bit stores) exactly as ``index_copy_``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from deltarl.rollout.engines import SamplingParams, VllmEngineSettings, make_engine
from deltarl.rollout.engines.vllm_mapping import fp8_specs, probe_views, specs_of
from deltarl.rollout.engines.vllm_transfer import FP8_ENVIRONMENT
from deltarl.rollout.sync.weights import WeightSync
from deltarl.teacher.engines.vllm_engine import shutdown_llm
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync import fp8
from deltarl.weightsync.delta import (
    apply_staged,
    compute_delta,
    stage_delta,
    verify_base,
    verify_result,
)
from deltarl.weightsync.digest import state_digest, tensor_digest
from deltarl.weightsync.reader import BucketReader

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _needs_vllm_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for key, value in FP8_ENVIRONMENT.items():  # CUTLASS or Triton: the checkpoint's bytes kept
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model runs in-process


def _common() -> dict[str, Any]:
    # every linear dimension a multiple of 128 (vLLM fuses q/k/v and gate/up by whole blocks)
    return {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.2,
    }


def _smollm2_shaped() -> Any:
    """SmolLM2-135M's widths (hidden 576, 9 heads of 64, 3 k/v heads: q 576 and k/v 192 rows,
    MLP 1536), 2 layers: no fused projection is whole 128-row blocks, so it needs 64 x 64."""
    return transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )


# layout -> (config, block side, the linear kernel vLLM must choose)
LAYOUTS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=4096, tie_word_embeddings=False, architectures=["LlamaForCausalLM"], **_common()
    ),
    "smollm2-shaped-64": _smollm2_shaped,
    # k/v projections of 2 heads x 128 = 256 rows: at tensor parallelism 2 each rank holds one
    # whole 128-row block of them (vLLM's loader cannot split a scale block between ranks;
    # tests/rollout/test_fp8_shards.py checks the split on CPU)
    "qwen3-tied": lambda: transformers.Qwen3Config(
        vocab_size=4096,
        head_dim=128,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
        **_common(),
    ),
}


def _bf16(cfg: Any, seed: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return hf, {n: p.detach().clone() for n, p in hf.named_parameters()}


def _step(state: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + torch.randn(t.shape, generator=g).sign() * lr).to(torch.bfloat16)
        for n, t in state.items()
    }


BLOCKS = {"smollm2-shaped-64": (64, 64)}  # the others: 128 x 128
KERNELS = {(128, 128): "CutlassFp8BlockScaledMMKernel", (64, 64): "TritonFp8BlockScaledMMKernel"}


def _write_checkpoint(
    cfg: Any, directory: Path, bf16: dict[str, torch.Tensor], block: tuple[int, int] = fp8.BLOCK
) -> None:
    """A DeepSeek-style block-fp8 checkpoint of ``bf16``: config.json with the
    quantization_config, model.safetensors with e4m3 weights, scales and bf16 tensors."""
    cfg.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = fp8.quantization_config(bf16, block)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(fp8.quantize_state(bf16, block), str(directory / "model.safetensors"))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _dequantized(state: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The bf16 weights an fp8 version stands for (e4m3 x scale per block)."""
    out = {}
    for n, t in state.items():
        if n.endswith(fp8.SCALE_SUFFIX):
            continue
        if t.dtype == fp8.FP8_DTYPE:
            t = fp8.dequantize_block_fp8(t, state[fp8.scale_name(n)], block).to(torch.bfloat16)
        out[n] = t
    return out


def _logprob_gap(hf: Any, weights: dict[str, torch.Tensor], prompts: Any, outs: Any) -> float:
    hf = hf.to("cuda")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(weights[name])
    diffs: list[float] = []
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        ids = torch.tensor([prompt + list(c.token_ids)], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        got = torch.tensor([next(iter(lp.values())).logprob for lp in c.logprobs])
        diffs += (ref.cpu() - got).abs().tolist()
    return statistics.mean(diffs)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_vllm_serves_the_checkpoints_fp8_bytes_and_takes_a_delta_bit_exactly(
    layout: str, tmp_path: Path
) -> None:
    import vllm

    cfg, block = LAYOUTS[layout](), BLOCKS.get(layout, fp8.BLOCK)
    hf, v0_bf16 = _bf16(cfg)
    v1_bf16 = _step(v0_bf16, 2e-3, seed=1)  # a step large enough to move e4m3 bytes
    _write_checkpoint(cfg, tmp_path / "model", v0_bf16, block)
    v0, v1 = fp8.quantize_state(v0_bf16, block), fp8.quantize_state(v1_bf16, block)
    delta = compute_delta(v0, v1, 0, 1)
    assert delta.changed and any(p.changed for n, p in delta.patches.items() if "proj" in n)
    specs = fp8_specs(specs_of(v0_bf16), block)
    assert {s.name for s in specs} == set(v0)

    llm = vllm.LLM(
        model=str(tmp_path / "model"),
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.1,
        max_model_len=512,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
    )
    prompts = [[5 + i, 17, 99, 3, 250 + i] for i in range(8)]
    params = vllm.SamplingParams(
        max_tokens=16, temperature=1.0, seed=0, logprobs=0, detokenize=False
    )
    tokens = [{"prompt_token_ids": p} for p in prompts]

    def served(model: torch.nn.Module) -> dict[str, Any]:
        """In vLLM's worker: the probe's views, what they hold, the kernels chosen."""
        views = probe_views(model, specs)
        kernels = {
            type(m.quant_method.fp8_linear).__name__
            for m in model.modules()
            if hasattr(getattr(m, "quant_method", None), "fp8_linear")
        }
        return {
            "kernels": sorted(kernels),
            "dtypes": {n: str(v.dtype) for n, v in views.items()},
            "digests": {n: tensor_digest(v) for n, v in views.items()},
        }

    def apply(model: torch.nn.Module) -> dict[str, Any]:
        """In vLLM's worker: stage the delta, apply it in one call, verify, as the weight
        sync does around its pause."""
        views = probe_views(model, specs)
        verify_base(views, delta)
        staged = stage_delta(delta, "cuda", views)
        torch.cuda.synchronize()
        how = apply_staged(views, staged)  # the paused window: one store launch per width
        torch.cuda.synchronize()
        digests = verify_result(views, delta)  # raises unless bytes and scales are the trainer's
        return {"how": how, "state_digest": state_digest(views), "n": len(digests)}

    try:
        (before,) = llm.apply_model(served)
        out0 = llm.generate(tokens, params)
        (report,) = llm.apply_model(apply)
        out1 = llm.generate(tokens, params)
    finally:
        shutdown_llm(llm)
        del llm
        torch.cuda.empty_cache()

    assert before["kernels"] == [KERNELS[block]], before["kernels"]
    assert before["dtypes"] == {n: str(t.dtype) for n, t in v0.items()}
    wrong = [n for n, d in before["digests"].items() if d != tensor_digest(v0[n])]
    assert not wrong, f"vLLM does not serve the checkpoint's bytes of {wrong[:5]}"
    assert report["state_digest"] == state_digest(v1) == delta.result_digest
    assert report["n"] == len(v1)
    print(f"{layout}: delta of {delta.changed} elements applied by {report['how']}, verified")

    gaps = {
        "dequantized v0": _logprob_gap(hf, _dequantized(v0, block), prompts, out0),
        "bf16 v0 (the trainer)": _logprob_gap(hf, v0_bf16, prompts, out0),
        "dequantized v1": _logprob_gap(hf, _dequantized(v1, block), prompts, out1),
        "dequantized v0 after v1 (stale)": _logprob_gap(hf, _dequantized(v0, block), prompts, out1),
    }
    print(f"{layout}: mean |logprob difference| of vLLM fp8 to transformers holding: {gaps}")
    assert all(g == g and g < 10 for g in gaps.values())


@pytest.mark.parametrize(("tp", "side"), [(1, 128), (2, 128), (1, 64)])
def test_vllm_engine_follows_an_fp8_bucket(
    tp: int, side: int, tmp_path: Path, bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """128: the engine starts from a block-fp8 checkpoint's config. 64: from a bf16 model's
    config with the engine's ``fp8_block`` (what fp8 workers of a run do), on SmolLM2's widths;
    the engine sets vLLM's environment itself."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    block = (side, side)
    if side == 128:
        cfg = LAYOUTS["qwen3-tied"]()
        _, v0_bf16 = _bf16(cfg)
        _write_checkpoint(cfg, tmp_path / "model", v0_bf16)  # the engine reads its config only
    else:
        cfg = _smollm2_shaped()
        _, v0_bf16 = _bf16(cfg)
        cfg.save_pretrained(tmp_path / "model")
        for key in FP8_ENVIRONMENT:
            monkeypatch.delenv(key)
    master = {n: t.float() for n, t in v0_bf16.items()}
    settings = PublishSettings(fp8=True, fp8_block=side, background=False, anchor_every=0)
    pub = WeightPublisher(bucket, settings)
    expected = []
    engine = make_engine(
        VllmEngineSettings(
            model=str(tmp_path / "model"),
            gpu_memory_utilization=0.1,
            max_model_len=512,
            enforce_eager=True,
            tensor_parallel_size=tp,
            fp8_block=None if side == 128 else side,
        )
    )
    try:
        sync = WeightSync(engine, BucketReader(bucket))
        prompts = [[5 + i, 17, 99, 3, 250 + i] for i in range(8)]
        for v in range(4):
            if v:
                g = torch.Generator().manual_seed(v)
                for t in master.values():
                    t.add_(torch.randn(t.shape, generator=g).sign() * 1e-3)
            pub.publish(master)
            expected.append(
                fp8.quantize_state({n: t.to(torch.bfloat16) for n, t in master.items()}, block)
            )
            report = sync.sync_to()
            assert report.version == v and [s.kind for s in report.steps] == (
                ["anchor"] if v == 0 else ["delta"]
            )
            out = sync.generate(prompts, SamplingParams(max_new_tokens=8, seed=0))
            assert all(sync.check(c) == "verified" and c.version_max == v for c in out)
        if tp == 1:
            views = engine.named_parameters()
            assert all(
                torch.equal(_bytes(views[n]).cpu(), _bytes(t).cpu())
                for n, t in expected[-1].items()
            )
        else:
            shards = engine.sharded_weights()
            assert shards.mismatches(list(expected[-1]), expected[-1]) == []
        pauses = sorted(s.pause_s for s in sync.timings if s.kind == "delta")
        print(
            f"fp8 {side}x{side} tp={tp}: 3 deltas verified, paused apply max "
            f"{pauses[-1] * 1e3:.2f} ms"
        )
    finally:
        engine.close()
        pub.close()


def test_store_kernel_writes_e4m3_bytes_into_unaligned_views() -> None:
    """The one-launch apply (a Triton store per bit width) on 8-bit patterns: e4m3 views at odd
    byte offsets of one fused tensor, beside float32 scales and bf16 tensors; the same bytes as
    ``index_copy_``, and nothing between the views touched."""
    pytest.importorskip("triton")
    from states import perturb

    g = torch.Generator().manual_seed(0)
    fused = torch.randint(0, 0x7E, (3 * 4096 + 11,), generator=g, dtype=torch.uint8)
    fused = fused.view(torch.float8_e4m3fn)
    old = {
        "qkv.q": fused[3 : 3 + 4096].view(64, 64),
        "qkv.k": fused[3 + 4096 : 3 + 2 * 4096].view(32, 128),
        "qkv.v": fused[5 + 2 * 4096 : 5 + 3 * 4096].view(4096),
        "qkv.scales": torch.rand(7, 3, generator=g),
        "norm": torch.randn(333, generator=g).to(torch.bfloat16),
    }
    new = perturb(old, 0.05, seed=1)
    delta = compute_delta(old, new, 0, 1)
    results = []
    for kernel in ("triton", "torch"):
        base = fused.cuda()
        state = {
            "qkv.q": base[3 : 3 + 4096].view(64, 64),
            "qkv.k": base[3 + 4096 : 3 + 2 * 4096].view(32, 128),
            "qkv.v": base[5 + 2 * 4096 : 5 + 3 * 4096].view(4096),
            "qkv.scales": old["qkv.scales"].cuda(),
            "norm": old["norm"].cuda(),
        }
        staged = stage_delta(delta, "cuda", state, kernel=kernel)
        how = apply_staged(state, staged)
        torch.cuda.synchronize()
        verify_result(state, delta)
        assert how == ("kernel" if kernel == "triton" else "index_copy")
        results.append(_bytes(base).cpu())
    assert torch.equal(results[0], results[1])
    gaps = torch.cat([results[0][:3], results[0][3 + 2 * 4096 : 5 + 2 * 4096], results[0][-6:]])
    assert torch.equal(
        gaps, torch.cat([_bytes(fused)[:3], _bytes(fused)[8195:8197], _bytes(fused)[-6:]])
    )
