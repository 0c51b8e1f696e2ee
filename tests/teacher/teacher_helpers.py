"""Helpers of the teacher tests: a tiny random Llama, its engine, settings and a live server."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers

from deltarl.teacher.engines.transformers_engine import TransformersTeacher
from deltarl.teacher.settings import TeacherSettings

TOKEN = "teacher-test-token-0123456789"
VOCAB = 96


def tiny_model(seed: int = 0, hidden_size: int = 32, vocab: int = VOCAB) -> torch.nn.Module:
    """A random two-layer Llama over ``vocab`` ids, float32, on CPU (4 heads: head dim
    ``hidden_size / 4``; vLLM's float32 attention needs at least 16, and its sampler's warm-up
    fails with an illegal memory access on a vocabulary as small as ``VOCAB``)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config)
    # a random init gives nearly uniform logits; scale the head so that distributions are peaked
    # and positions differ clearly
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model.eval()


def tiny_engine(seed: int = 0) -> TransformersTeacher:
    return TransformersTeacher(tiny_model(seed), model_name="tiny-llama")


def settings(**overrides: Any) -> TeacherSettings:
    """Settings independent of the caller's DELTARL_TEACHER_* environment."""
    return TeacherSettings.model_validate({"token": TOKEN, "batch_window_ms": 0} | overrides)


def reference(
    model: torch.nn.Module,
    tokens: list[int],
    prompt_len: int,
    temperature: float = 1.0,
    shift: int = 0,
) -> np.ndarray:
    """log_softmax(logits / T) of the scored positions, one sequence alone (no padding):
    rows ``prompt_len - 1 + shift .. len - 2 + shift`` of the logits."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp[prompt_len - 1 + shift : len(tokens) - 1 + shift].numpy()


def random_sequences(
    n: int, seed: int = 0, lo: int = 3, hi: int = 40
) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    seqs, prompts = [], []
    for _ in range(n):
        length = int(rng.integers(lo, hi))
        seqs.append(rng.integers(0, VOCAB, length).tolist())
        prompts.append(int(rng.integers(1, length)))
    return seqs, prompts
