"""The vLLM teacher engine. The conversion of vLLM's ``prompt_logprobs`` runs everywhere (on
stand-ins of vLLM's ``Logprob``); the engine itself needs vLLM 0.33.0 and a CUDA GPU (marker
``gpu``) (bench/teacher_vllm_check.py, docs/benchmarks.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from teacher_helpers import random_sequences, tiny_model

from deltarl.teacher.engines.base import ScoreJob
from deltarl.teacher.engines.vllm_engine import VllmTeacher, _scores


@dataclass
class FakeLogprob:  # vllm.logprobs.Logprob's fields
    logprob: float
    rank: int
    decoded_token: str | None = None


def test_prompt_logprobs_become_rows() -> None:
    tokens = np.asarray([5, 7, 9, 11], np.int32)
    # position 0: None; the sampled token is in the top-k at position 2, outside it at 3
    plp = [
        None,
        {7: FakeLogprob(-0.5, 1), 3: FakeLogprob(-1.5, 2)},
        {1: FakeLogprob(-0.2, 1), 9: FakeLogprob(-1.0, 2)},
        {11: FakeLogprob(-6.0, 40), 2: FakeLogprob(-0.1, 1), 4: FakeLogprob(-2.5, 2)},
    ]
    out = _scores(ScoreJob(tokens, 2, 1.0, 2), plp)  # type: ignore[arg-type]
    assert out.sampled.tolist() == [-1.0, -6.0]
    assert out.top_ids.tolist() == [[1, 9], [2, 4]]
    np.testing.assert_allclose(out.top_logprobs, [[-0.2, -1.0], [-0.1, -2.5]])
    k0 = _scores(ScoreJob(tokens, 1, 1.0, 0), plp)  # type: ignore[arg-type]
    assert k0.top_ids.shape == (3, 0) and k0.sampled.tolist() == [-0.5, -1.0, -6.0]
    short = _scores(ScoreJob(tokens, 3, 1.0, 3), plp[:4])  # type: ignore[arg-type]
    assert short.top_ids.tolist() == [[2, 4, -1]] and math.isinf(short.top_logprobs[0, 2])


def test_the_engine_needs_no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model directory without tokenizer files (a converted or random checkpoint) must
    serve: the engine builds vLLM with ``skip_tokenizer_init`` and never detokenizes (on a GPU
    the engine once failed at start with "Couldn't instantiate the backend tokenizer")."""
    import sys
    import types

    built: dict[str, object] = {}
    requests: list[dict[str, object]] = []

    shutdowns: list[bool] = []

    class FakeLLM:
        def __init__(self, **kwargs: object) -> None:
            built.update(kwargs)
            config = types.SimpleNamespace(get_vocab_size=lambda: 32)
            core = types.SimpleNamespace(shutdown=lambda: shutdowns.append(True))
            self.llm_engine = types.SimpleNamespace(model_config=config, engine_core=core)

        def generate(self, prompts: list[object], params: list[object], use_tqdm: bool) -> list:
            requests.extend(vars(p) for p in params)
            plp = [None, {7: FakeLogprob(-0.5, 1)}]
            return [types.SimpleNamespace(prompt_logprobs=plp) for _ in prompts]

    class FakeParams:
        def __init__(self, **kwargs: object) -> None:
            self.__dict__.update(kwargs)

    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM  # type: ignore[attr-defined]
    fake.SamplingParams = FakeParams  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    engine = VllmTeacher.load(
        "/no/tokenizer/here",
        dtype="bfloat16",
        max_top_k=8,
        max_seq_len=64,
        gpu_memory_utilization=0.3,
        name="m",
        enforce_eager=True,
    )
    assert built["skip_tokenizer_init"] is True and engine.vocab_size == 32
    assert built["enforce_eager"] is True
    out = engine.score([ScoreJob(np.asarray([5, 7], np.int32), 1, 1.0, 1)])
    assert out[0].sampled.tolist() == [-0.5]
    assert requests and all(r["detokenize"] is False for r in requests)
    engine.close()  # the engine core process stops (it holds the GPU memory)
    assert shutdowns == [True]


@pytest.mark.gpu
def test_vllm_matches_transformers_on_a_gpu(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from deltarl.teacher.engines.transformers_engine import TransformersTeacher

    model = tiny_model(hidden_size=64, vocab=4096)  # the sequences use ids < VOCAB
    model.save_pretrained(tmp_path / "model")
    seqs, prompts = random_sequences(6, seed=4)
    jobs = [
        ScoreJob(np.asarray(s, np.int32), p, 1.0, 8) for s, p in zip(seqs, prompts, strict=True)
    ]
    vllm = VllmTeacher.load(
        str(tmp_path / "model"),
        dtype="float32",
        max_top_k=8,
        max_seq_len=64,
        # small: float32 runs vLLM's FlexAttention, whose block table grows with the KV cache
        # (at 0.3 of an H200 it asked for 40 GiB more at its first forward)
        gpu_memory_utilization=0.05,
        name="tiny",
    )
    assert vllm.check_temperature(0.5) is not None
    hf = TransformersTeacher(model.to("cuda"))
    pairs = list(zip(vllm.score(jobs), hf.score(jobs), strict=True))
    worst = max(float(np.abs(a.sampled - b.sampled).max()) for a, b in pairs)
    print(f"vllm vs transformers, float32: max |sampled logprob diff| {worst:.2e}")
    for a, b in pairs:
        np.testing.assert_allclose(a.sampled, b.sampled, atol=1e-3)
        np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, atol=1e-3)
