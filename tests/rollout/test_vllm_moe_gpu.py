"""Mixture-of-experts models against real vLLM 0.33.0 on CUDA GPUs (marked ``gpu``: CI never
runs them; ``pytest -m gpu tests/rollout/test_vllm_moe_gpu.py``, ~3-5 minutes on one H100, the
TP=2 and expert-parallel cases skipped without a second GPU). When they last ran, and where, is
in docs/vllm.md ("Mixture of experts").

A tiny random Qwen3-MoE checkpoint (16 experts, top-4, peaked weights) is written to a temp dir
and served by the vllm engine (vLLM's fused-MoE kernels; ``load_format="dummy"``, so the bucket's
anchor supplies the weights). A trainer (transformers, fp32 master weights, the trainer's
``WeightPublisher``) takes real AdamW steps and publishes each; the engine follows:

* the probe maps every tensor the trainer publishes, the stacked expert tensors included (TP=1:
  one view of ``w13_weight`` / ``w2_weight`` per layer; TP=2 and EP=2: one box per rank);
* every delta lands in one pause, written by the store kernel (one launch for every expert of
  every layer: the staged delta has one address list), and is verified bit-exactly (TP=1: the
  views hash to the trainer's digests; TP=2: every rank's shard against the verified mirror);
* generation changes after the applies, and the processed logprobs are those of the
  transformers model holding the trainer's weights (kernel noise, far below a wrong mapping's
  difference: layer 0's gate and up halves swapped in every expert);
* in block fp8 (``publish.fp8``, the engine's ``fp8_block``), the same at TP 1, TP 2 and EP 2:
  vLLM's fused experts in fp8 hold the trainer's e4m3 bytes and scales after every delta.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from deltarl.rollout.engines import SamplingParams, VllmEngineSettings, make_engine
from deltarl.rollout.engines.vllm_transfer import FP8_ENVIRONMENT
from deltarl.rollout.sync.weights import WeightSync
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync import fp8
from deltarl.weightsync.delta import compute_delta, stage_delta
from deltarl.weightsync.model_state import publishable_state
from deltarl.weightsync.reader import BucketReader

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS = 3
PROMPTS = [[5 + i, 17, 99, 3, 250 + i] for i in range(8)]


@pytest.fixture(autouse=True)
def _needs_vllm_on_a_gpu() -> None:
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def moe_config() -> transformers.Qwen3MoeConfig:
    # initializer_range 0.2: peaked distributions, so a wrong mapping shows in the logprobs
    return transformers.Qwen3MoeConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )


def trainer_model(cfg: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to("cuda")


def trainer_and_engine(cfg: Any, tmp_path: Path, tp: int, ep: bool, **engine: Any) -> Any:
    """The trainer's model (CUDA, fp32) and a vllm engine serving ``cfg`` (dummy weights until
    the bucket's anchor) at tensor parallelism ``tp``, with expert parallelism if ``ep``."""
    cfg.save_pretrained(tmp_path / "model")
    model = trainer_model(cfg)
    settings = VllmEngineSettings(
        model=str(tmp_path / "model"),
        gpu_memory_utilization=0.15,
        max_model_len=512,
        enforce_eager=True,
        tensor_parallel_size=tp,
        expert_parallel=ep,
        **engine,
    )
    return model, make_engine(settings)


def adamw_steps(model: torch.nn.Module, steps: int, lr: float) -> Any:
    """Real AdamW steps (next-token loss on random tokens, bf16 autocast); yields after each."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 1000, (8, 64), generator=g).to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield


def published(model: torch.nn.Module, pub: WeightPublisher) -> dict[str, torch.Tensor]:
    """What a worker must hold: the publisher's cast of every tensor, on the host."""
    return {n: t.detach().to(pub.dtype_of(n)).cpu() for n, t in publishable_state(model).items()}


def swap_gate_up(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A wrong mapping: layer 0's gate and up halves swapped in every expert."""
    out = dict(state)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    gate, up = state[name].chunk(2, dim=1)
    out[name] = torch.cat([up, gate], dim=1)
    return out


def check_logprobs(cfg: Any, state: dict[str, torch.Tensor], out: list[Any]) -> str:
    """vLLM's processed logprobs (T=1) against the transformers model holding ``state`` (bf16),
    and against a wrongly mapped state: the first must be far below the second."""
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to("cuda")
    means, worst = {}, 0.0
    for label, weights in (("right", state), ("wrong", swap_gate_up(state))):
        with torch.no_grad():
            for name, t in publishable_state(hf).items():
                t.copy_(weights[name])
        diffs = []
        for prompt, c in zip(PROMPTS, out, strict=True):
            ids = torch.tensor([prompt + c.token_ids], device="cuda")
            with torch.no_grad():
                logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])
            diffs += (ref.squeeze(-1).cpu() - torch.tensor(c.logprobs)).abs().tolist()
        means[label] = statistics.mean(diffs)
        if label == "right":
            worst = max(diffs)
    # routing flips (a token's top-k decided by a near tie) make the gap larger than on a dense
    # model; the bound is the generation check's, the wrong mapping must be far above it
    assert means["right"] < 0.3, means
    assert means["wrong"] > 3 * means["right"], means
    return f"|logprob diff| mean {means['right']:.4f} (max {worst:.3f}), wrong {means['wrong']:.3f}"


@pytest.mark.parametrize(
    ("tp", "ep"), [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-ep"]
)
def test_moe_follows_real_trainer_steps_in_one_pause_bit_exactly(
    tp: int, ep: bool, tmp_path: Path, bucket: Any
) -> None:
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    cfg = moe_config()
    model, engine = trainer_and_engine(cfg, tmp_path, tp, ep)
    try:
        with WeightPublisher(bucket) as pub:
            pub.follow_precision(model)
            pub.publish(publishable_state(model), anchor=True)
            pub.wait()
            names = set(publishable_state(model))
            shards = engine.sharded_weights()
            if shards is None:  # TP=1: one view of vLLM's stacked parameter per expert tensor
                views = engine.named_parameters()
                assert set(views) == names
                for layer in range(cfg.num_hidden_layers):
                    up = views[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
                    assert tuple(up.shape) == (16, 256, 256) and up.is_contiguous()
            else:  # every rank's box of every tensor, experts included
                assert shards.ranks == tp and all(set(b) == names for b in shards.boxes)
                up = [b["model.layers.0.mlp.experts.gate_up_proj"] for b in shards.boxes]
                if ep:  # whole experts, 8 per rank
                    assert [(u.start[0], u.size[0]) for u in up] == [(0, 8), (8, 8)]
                else:  # every expert's gate and up rows of the rank: [E, 2, I, H] boxes
                    assert [u.start for u in up] == [(0, 0, 0, 0), (0, 0, 64, 0)]
            sync = WeightSync(engine, BucketReader(bucket))
            sync.sync_to()
            sampled = SamplingParams(max_new_tokens=16, seed=3)
            before = [(c.token_ids, c.logprobs) for c in sync.generate(PROMPTS, sampled)]
            v0 = published(model, pub)
            for _ in adamw_steps(model, STEPS, lr=3e-3):
                pub.publish(publishable_state(model))
                pub.wait()
            state = published(model, pub)
        report = sync.sync_to()
        assert report.version == STEPS and [s.kind for s in report.steps] == ["delta"] * STEPS
        # one pause each, written by the store kernel (one launch per bit width: bf16 only here)
        assert [s.apply for s in report.steps] == ["kernel"] * STEPS, report.steps
        pauses = [s.pause_s * 1e3 for s in report.steps]
        if shards is None:
            assert sync.verified_digest() is not None
            views = engine.named_parameters()
            for name, t in state.items():
                assert torch.equal(views[name].cpu().view(torch.int16), t.view(torch.int16)), name
            # the staged form of a delta of every expert: one address list for all of them
            delta = compute_delta(v0, state, 0, STEPS)
            staged = stage_delta(delta, views[next(iter(views))].device, views)
            assert staged.stores is not None and len(staged.stores) == 1
            assert int(staged.stores[0][0].numel()) == delta.changed
        else:
            assert shards.mismatches(list(state), state) == []
        out = sync.generate(PROMPTS, SamplingParams(max_new_tokens=24, seed=0))
        assert all(sync.check(c) == "verified" and c.version_max == STEPS for c in out)
        after = [(c.token_ids, c.logprobs) for c in sync.generate(PROMPTS, sampled)]
        assert after != before  # the served model is the trained one (tokens or logprobs)
    finally:
        engine.close()
    experts = sum(
        int((state[n].view(torch.int16) != v0[n].view(torch.int16)).sum())
        for n in state
        if ".mlp.experts." in n
    )
    print(
        f"moe tp={tp} ep={ep}: pauses {', '.join(f'{p:.2f}' for p in pauses)} ms, "
        f"{experts} expert elements changed over {STEPS} steps; " + check_logprobs(cfg, state, out)
    )


def fp8_moe_config() -> transformers.Qwen3MoeConfig:
    """moe_config with every fused shard whole 128-row blocks at TP 2 (q/k/v 256 rows, experts'
    gate and up 256 rows each, down 256 columns): vLLM's loader does not split a block."""
    cfg = moe_config()
    cfg.moe_intermediate_size = 256
    cfg.num_key_value_heads = 4
    return cfg


@pytest.mark.parametrize(
    ("tp", "ep"), [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-ep"]
)
def test_fp8_moe_follows_real_trainer_steps_bit_exactly(
    tp: int, ep: bool, tmp_path: Path, bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block-fp8 experts (``publish.fp8``, the engine's ``fp8_block`` over a bf16 config, as a
    run's fp8 workers start): the trainer's CUDA weights quantized on its GPU, every delta's
    e4m3 bytes and scales of every expert landing in one pause, every rank bit-identical to
    the trainer's quantization."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    for key in FP8_ENVIRONMENT:  # the engine sets vLLM's environment itself
        monkeypatch.delenv(key, raising=False)
    cfg = fp8_moe_config()
    model, engine = trainer_and_engine(cfg, tmp_path, tp, ep, fp8_block=128)
    settings = PublishSettings(fp8=True, fp8_block=128, background=False, anchor_every=0)
    try:
        with WeightPublisher(bucket, settings) as pub:
            pub.follow_precision(model)
            pub.publish(publishable_state(model), anchor=True)
            sync = WeightSync(engine, BucketReader(bucket))
            assert sync.sync_to().version == 0
            for _ in adamw_steps(model, STEPS, lr=3e-3):
                pub.publish(publishable_state(model))
            state = fp8.quantize_state(published(model, pub))
        report = sync.sync_to()
        assert report.version == STEPS and [s.kind for s in report.steps] == ["delta"] * STEPS
        assert [s.apply for s in report.steps] == ["kernel"] * STEPS, report.steps
        up = "model.layers.0.mlp.experts.gate_up_proj"
        assert state[up].dtype == torch.float8_e4m3fn and fp8.scale_name(up) in state
        shards = engine.sharded_weights()
        if shards is None:
            views = engine.named_parameters()
            assert set(views) == set(state)
            for name, t in state.items():
                assert torch.equal(views[name].cpu().view(torch.uint8), t.view(torch.uint8)), name
        else:
            assert shards.mismatches(list(state), state) == []
        out = sync.generate(PROMPTS, SamplingParams(max_new_tokens=16, seed=0))
        assert all(sync.check(c) == "verified" and c.version_max == STEPS for c in out)
    finally:
        engine.close()
    pauses = [s.pause_s * 1e3 for s in report.steps]
    print(f"fp8 moe tp={tp} ep={ep}: pauses {', '.join(f'{p:.2f}' for p in pauses)} ms")
