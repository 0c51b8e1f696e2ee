"""The embedded transformers engine serving mixture-of-experts models (tiny random Qwen3-MoE and
DeepSeek-V3 with shared experts and a router transformers keeps in fp32): generation, logprobs,
and the trainer's own publisher followed in place, bit-exactly, versions verified by digests.

transformers 5 holds the routed experts stacked (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj`` ``[E, H, I]``), so a layer's experts are two tensors to patch, not
3 x E."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from moe_helpers import deepseek_v3_config, hf_moe_model, qwen3_moe_config

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.engines.base import SamplingParams
from deltarl.rollout.engines.transformers_engine import TransformersEngine
from deltarl.rollout.sync.weights import WeightSync
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.weightsync.digest import state_digest
from deltarl.weightsync.model_state import fp32_names, publishable_state
from deltarl.weightsync.reader import BucketReader

PROMPTS = [[5, 9, 2, 7], [11, 3], [40, 41, 42, 43, 44, 45]]
CONFIGS = {"qwen3_moe": qwen3_moe_config, "deepseek_v3": deepseek_v3_config}
# DeepSeek-V3's modeling code takes ~8 s to import on 2 cores
KINDS = ["qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)]


def config(kind: str) -> Any:
    return CONFIGS[kind]()


@pytest.mark.parametrize("kind", KINDS)
def test_generation_and_logprobs_of_a_moe_model(kind: str) -> None:
    engine = TransformersEngine(hf_moe_model(config(kind), seed=1, dtype=torch.float32), seed=1)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    batched = engine.generate(PROMPTS, greedy)
    for prompt, got in zip(PROMPTS, batched, strict=True):  # left padding changes no routing
        assert got.token_ids == engine.generate([prompt], greedy)[0].token_ids
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=4)
    out = engine.generate(PROMPTS, params)
    # the sampled tokens' logprobs: those of one teacher-forced pass (float32)
    items = [(p + c.token_ids, len(p)) for p, c in zip(PROMPTS, out, strict=True)]
    scored = engine.score_batch(items, k=1)
    for c, s in zip(out, scored, strict=True):
        assert len(c.logprobs) == len(s.sampled) == 6
        assert max(abs(a - b) for a, b in zip(c.logprobs, s.sampled, strict=True)) < 1e-4


def test_the_engine_holds_what_the_trainer_publishes() -> None:
    """Names, shapes and dtypes: DeepSeek-V3's router and its bias (a buffer) in fp32 inside a
    bf16 model, as transformers builds it; Qwen3-MoE's router in bf16."""
    for kind, fp32 in (("qwen3_moe", set()), ("deepseek_v3", {"gate.weight", "bias"})):
        engine = TransformersEngine(hf_moe_model(config(kind)))
        params = engine.named_parameters()
        trainer = hf_moe_model(config(kind), dtype=torch.float32)  # fp32 master weights
        keep = fp32_names(trainer, torch.bfloat16)
        assert set(params) == set(publishable_state(trainer))
        for name, t in params.items():
            want = torch.float32 if name in keep else torch.bfloat16
            assert t.dtype == want, name
        assert {n.rsplit("_", 1)[-1] if n.endswith("bias") else "gate.weight" for n in keep} == (
            fp32
        )
        stacked = [n for n in params if ".mlp.experts." in n]
        moe_layers = sum(1 for n in params if n.endswith("mlp.experts.down_proj"))
        assert len(stacked) == 2 * moe_layers and moe_layers >= 1


def adamw_steps(model: torch.nn.Module, steps: int, lr: float, seed: int) -> Any:
    """Real AdamW steps of a next-token loss on random tokens; yields after each."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 100, (4, 12), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield


@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_follows_the_trainers_moe_versions_bit_exactly(
    kind: str, tmp_path: Path
) -> None:
    trainer = hf_moe_model(config(kind), seed=2, dtype=torch.float32)
    bucket = LocalBucket(tmp_path / "bucket")
    engine = TransformersEngine(hf_moe_model(config(kind), seed=7), seed=0)  # other weights
    sync = WeightSync(engine, BucketReader(bucket))
    probe = [(PROMPTS[2] + [1, 2, 3], len(PROMPTS[2]))]
    with WeightPublisher(bucket) as pub:
        keep = pub.follow_precision(trainer)
        assert bool(keep) == (kind == "deepseek_v3")
        pub.publish(publishable_state(trainer), anchor=True)
        pub.wait()
        sync.sync_to()
        before = engine.score_batch(probe, k=1)[0].sampled
        for _ in adamw_steps(trainer, 3, lr=1e-3, seed=3):
            pub.publish(publishable_state(trainer))
            pub.wait()
        report = sync.sync_to()
    assert report.version == 3 and [s.kind for s in report.steps] == ["delta"] * 3
    want = {n: t.detach().to(pub.dtype_of(n)) for n, t in publishable_state(trainer).items()}
    got = engine.named_parameters()
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    assert sync.verified_digest() == (3, state_digest(want))
    # the experts moved: some elements of the stacked tensors changed, in place
    reader = BucketReader(bucket)
    assert reader.manifest(3).objects[0].changed
    after = engine.score_batch(probe, k=1)[0].sampled
    assert after != before  # the served model is the new one
    out = sync.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3, seed=1))
    assert out[0].version_max == 3 and sync.check(out[0]) == "verified"
