"""The transformers engine against a plain per-sequence computation: one padded batch gives the
same scores as each sequence alone (within float tolerance), at the right positions."""

from __future__ import annotations

import numpy as np
import torch
from teacher_helpers import VOCAB, random_sequences, reference, tiny_engine, tiny_model

from deltarl.teacher.engines.base import ScoreJob
from deltarl.teacher.engines.transformers_engine import TransformersTeacher

ATOL = 2e-4  # float32 on CPU: padding and batching change the summation order only


def jobs_of(
    seqs: list[list[int]], prompts: list[int], temps: list[float], k: int
) -> list[ScoreJob]:
    return [
        ScoreJob(np.asarray(s, np.int32), p, t, k)
        for s, p, t in zip(seqs, prompts, temps, strict=True)
    ]


def test_a_batch_equals_each_sequence_alone() -> None:
    engine = tiny_engine()
    seqs, prompts = random_sequences(9, seed=1)
    temps = [1.0, 0.5, 2.0, 0.7, 1.0, 1.3, 1.0, 0.9, 3.0]
    jobs = jobs_of(seqs, prompts, temps, k=12)
    batched = engine.score(jobs)
    for job, got in zip(jobs, batched, strict=True):
        want = reference(engine.model, job.tokens.tolist(), job.prompt_len, job.temperature)
        rows = np.arange(job.scored)
        targets = job.tokens[job.prompt_len :]
        assert got.sampled.shape == (job.scored,) and got.top_ids.shape == (job.scored, 12)
        np.testing.assert_allclose(got.sampled, want[rows, targets], atol=ATOL)
        order = np.argsort(-want, axis=1)[:, :12]
        np.testing.assert_allclose(got.top_logprobs, np.take_along_axis(want, order, 1), atol=ATOL)
        # ids agree wherever the values are not (near-)ties
        gaps = np.diff(np.sort(want, axis=1)[:, ::-1][:, :13], axis=1)
        clear = (np.abs(gaps[:, :12]) > 1e-3) & (
            np.abs(np.pad(gaps, ((0, 0), (1, 0)))[:, :12]) > 1e-3
        )
        assert (got.top_ids[clear] == order[clear]).all()
        assert (np.diff(got.top_logprobs, axis=1) <= 0).all()


def test_the_tolerance_catches_a_position_shift() -> None:
    """A scorer off by one position would be far outside the tolerance used above."""
    model = tiny_model()
    seqs, prompts = random_sequences(4, seed=2, lo=8)
    checked = 0
    for s, p in zip(seqs, prompts, strict=True):
        if p < 2 or p >= len(s) - 1:
            continue
        right = reference(model, s, p)[:-1]
        for shift in (-1, 1):
            wrong = reference(model, s, p, shift=shift)[: len(right)]
            assert np.abs(right - wrong).max() > 100 * ATOL
            checked += 1
    assert checked >= 4


def test_temperature_scales_the_logits() -> None:
    engine = tiny_engine()
    tokens = np.asarray([3, 14, 15, 92, 65, 35], np.int32)
    cold, hot = engine.score([ScoreJob(tokens, 2, 0.5, 5), ScoreJob(tokens, 2, 2.0, 5)])
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.from_numpy(tokens.astype(np.int64))[None]).logits[0]
    for got, t in ((cold, 0.5), (hot, 2.0)):
        want = torch.log_softmax(logits[1:5].float() / t, -1).numpy()
        np.testing.assert_allclose(got.sampled, want[np.arange(4), tokens[2:]], atol=ATOL)
    assert cold.top_logprobs[:, 0].mean() > hot.top_logprobs[:, 0].mean()  # sharper when cold


def test_edge_cases() -> None:
    engine = tiny_engine()
    tokens = np.asarray([1, 2, 3], np.int32)
    nothing, full, k0 = engine.score(
        [
            ScoreJob(tokens, 3, 1.0, 4),
            ScoreJob(tokens, 1, 1.0, VOCAB + 50),
            ScoreJob(tokens, 1, 1.0, 0),
        ]
    )
    assert nothing.sampled.shape == (0,) and nothing.top_ids.shape == (0, 4)
    assert full.top_ids.shape == (2, VOCAB)  # k is capped at the vocabulary
    np.testing.assert_allclose(np.exp(full.top_logprobs).sum(1), 1.0, atol=1e-4)
    assert k0.top_ids.shape == (2, 0) and k0.sampled.shape == (2,)
    assert engine.score([]) == []


def test_without_logits_to_keep() -> None:
    """Models whose forward has no ``logits_to_keep`` are scored from the full logits."""
    engine = tiny_engine()
    seqs, prompts = random_sequences(3, seed=5)
    jobs = jobs_of(seqs, prompts, [1.0] * 3, k=3)
    fast = engine.score(jobs)
    plain = TransformersTeacher(engine.model)
    plain._keep = False
    for a, b in zip(fast, plain.score(jobs), strict=True):
        np.testing.assert_allclose(a.sampled, b.sampled, atol=ATOL)
