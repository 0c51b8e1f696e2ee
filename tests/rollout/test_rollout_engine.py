"""The transformers engine on a tiny random Llama: batching, sampling, logprobs, determinism."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter, ValidationError
from rollout_helpers import tiny_config, tiny_engine

from deltarl.rollout.engines import (
    UNMANAGED,
    EngineSettings,
    SamplingParams,
    TransformersEngineSettings,
    VllmEngineSettings,
    make_engine,
)
from deltarl.rollout.engines.transformers_engine import TransformersEngine, sample_tokens

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10], [4]]


@pytest.fixture(scope="module")
def engine() -> TransformersEngine:
    return tiny_engine(seed=0)


def test_batched_greedy_equals_one_by_one(engine: TransformersEngine) -> None:
    """Left padding must not change what a prompt generates."""
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    batched = engine.generate(PROMPTS, greedy)
    for prompt, got in zip(PROMPTS, batched, strict=True):
        alone = engine.generate([prompt], greedy)[0]
        assert got.token_ids == alone.token_ids
        assert got.logprobs == [0.0] * 6 and got.finish_reason == "length"
        assert got.first == got.last == UNMANAGED and got.version_min is None


def test_logprobs_are_those_of_the_processed_distribution() -> None:
    """Re-score the sampled tokens with one teacher-forced forward pass over prompt+completion
    (in float32: the KV cache and the full pass then agree to rounding, so any difference in the
    processing shows)."""
    engine = tiny_engine(seed=0, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=20, top_p=0.9, seed=3)
    for prompt in PROMPTS:
        c = engine.generate([prompt], params)[0]
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0].float()
        for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            row = logits[len(prompt) - 1 + j][None]
            # recompute with the same processing, greedy-free: the logprob of the sampled token
            z = row / 0.7
            kth = torch.topk(z, 20).values[:, -1:]
            z = z.masked_fill(z < kth, float("-inf"))
            p = torch.softmax(z, -1)
            sp, order = torch.sort(p, descending=True)
            keep_sorted = (sp.cumsum(-1) - sp) < 0.9
            keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
            z = z.masked_fill(~keep, float("-inf"))
            want = torch.log_softmax(z, -1)[0, tok].item()
            assert abs(want - lp) < 1e-3, (j, want, lp)
            assert lp > torch.log_softmax(row / 0.7, -1)[0, tok].item() - 1e-4  # truncation


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(max_new_tokens=1, top_p=0.8)
    seen = set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        tok, lp = sample_tokens(logits, params, gen)
        seen.add(int(tok))
        want = {0: 0.5 / 0.8, 1: 0.3 / 0.8}[int(tok)]
        assert abs(lp.item() - torch.log(torch.tensor(want)).item()) < 1e-5
    assert seen == {0, 1}
    tok, lp = sample_tokens(logits, SamplingParams(max_new_tokens=1, top_k=1), gen)
    assert int(tok) == 0 and lp.item() == 0.0


def test_seed_makes_sampling_deterministic(engine: TransformersEngine) -> None:
    params = SamplingParams(max_new_tokens=8, seed=11)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    c = engine.generate(PROMPTS, params.model_copy(update={"seed": 12}))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # without a seed the engine's own generator advances: two calls differ
    d = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    e = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    assert [x.token_ids for x in d] != [x.token_ids for x in e]


def test_stop_tokens_end_each_row(engine: TransformersEngine) -> None:
    free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=5))
    stop = free[1].token_ids[3]  # a token row 1 samples at step 3
    stopped = engine.generate(
        PROMPTS, SamplingParams(max_new_tokens=12, seed=5, stop_token_ids=(stop,))
    )
    for f, s in zip(free, stopped, strict=True):
        if stop in f.token_ids:
            cut = f.token_ids.index(stop) + 1
            assert s.token_ids == f.token_ids[:cut] and s.finish_reason == "stop"
            assert s.logprobs == f.logprobs[:cut]
        else:
            assert s.token_ids == f.token_ids and s.finish_reason == "length"
    assert stopped[1].finish_reason == "stop" and len(stopped[1].token_ids) <= 4


def test_bad_input_is_refused(engine: TransformersEngine) -> None:
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one prompt"):
        engine.generate([], params)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 128]], params)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=1, top_p=0.0)


def test_named_parameters_are_the_live_bf16_weights(engine: TransformersEngine) -> None:
    params = engine.named_parameters()
    assert "model.embed_tokens.weight" in params and "lm_head.weight" in params
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in params.values())
    assert engine.device == torch.device("cpu")
    w = params["lm_head.weight"]
    assert w.data_ptr() == dict(engine.model.named_parameters())["lm_head.weight"].data_ptr()


def test_make_engine_from_a_config_directory(tmp_path: Path) -> None:
    tiny_config().save_pretrained(tmp_path)
    engine = make_engine(TransformersEngineSettings(model=str(tmp_path), device="cpu", seed=1))
    assert isinstance(engine, TransformersEngine)
    assert engine.type == "transformers"
    assert all(t.dtype == torch.bfloat16 for t in engine.named_parameters().values())
    out = engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))
    assert len(out[0].token_ids) == 3
    with pytest.raises(ModuleNotFoundError, match=r"deltarl\[vllm\]"):
        make_engine(VllmEngineSettings(model="x"))


def test_engine_settings_pick_the_engine_by_type() -> None:
    adapter: TypeAdapter[TransformersEngineSettings | VllmEngineSettings] = TypeAdapter(
        EngineSettings
    )
    s = adapter.validate_python({"type": "transformers", "model": "m", "device": "cpu"})
    assert isinstance(s, TransformersEngineSettings) and s.dtype == "bfloat16"
    assert isinstance(adapter.validate_python({"type": "vllm", "model": "m"}), VllmEngineSettings)
    with pytest.raises(ValidationError):
        adapter.validate_python({"type": "sglang", "model": "m"})
    with pytest.raises(ValidationError):
        adapter.validate_python({"type": "transformers", "model": "m", "temperature": 1.0})


def test_make_engine_loads_pretrained_weights(tmp_path: Path) -> None:
    source = tiny_engine(seed=7)
    source.model.save_pretrained(tmp_path)
    engine = make_engine(
        TransformersEngineSettings(model=str(tmp_path), init="pretrained", device="cpu")
    )
    assert engine.named_parameters().keys() == source.named_parameters().keys()
    for name, t in source.named_parameters().items():
        assert torch.equal(engine.named_parameters()[name], t)
