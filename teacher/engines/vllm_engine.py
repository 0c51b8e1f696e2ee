"""The vLLM teacher engine, written against vLLM 0.33.0's offline API. Measured on H100/H200
GPUs (``bench/teacher_vllm_check.py`` and the ``gpu`` test: float32 scores equal the
transformers engine's to 1e-5 on a tiny model and 0.002 on a SmolLM2-shaped one, docs/teacher.md);
vLLM is not installable on the machines this was written on. No tokenizer is loaded
(``skip_tokenizer_init``): requests are token ids, answers are logprobs of ids.

Each sequence is one ``TokensPrompt`` generated with ``SamplingParams(max_tokens=1,
prompt_logprobs=k)``: vLLM then returns, for every prompt position after the first, a dict
``{token id: Logprob(logprob, rank, decoded_token)}`` holding the top-k entries *and* the token
that actually came next (with its own rank), which is exactly what the service answers. vLLM
batches the prompts itself (continuous batching), so the whole batch is one ``generate`` call.

Limits, both from vLLM rather than from us:

* prompt logprobs are always those of the raw distribution (vLLM's ``logprobs_mode`` and the
  request's temperature apply to sampled tokens only; vllm-project/vllm#47680), so this engine
  scores at temperature 1.0 only and the service refuses any other temperature with a 422;
* ``max_logprobs`` (the engine's cap on k) is set to the service's top-k limit at start.

vLLM is imported when the engine is built, never at module import.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from deltarl.teacher.engines.base import ScoreJob, Scores

logger = logging.getLogger(__name__)


class VllmTeacher:
    """``vllm.LLM`` scoring prompts through ``prompt_logprobs``."""

    engine = "vllm"

    def __init__(self, llm: Any, model_name: str, max_top_k: int) -> None:
        self.llm = llm
        self.model_name = model_name
        config = llm.llm_engine.model_config
        self.vocab_size = int(config.get_vocab_size())
        self.max_top_k = max_top_k

    @classmethod
    def load(
        cls,
        model: str,
        *,
        dtype: str,
        max_top_k: int,
        max_seq_len: int,
        gpu_memory_utilization: float,
        name: str,
        enforce_eager: bool = False,
    ) -> VllmTeacher:
        from vllm import LLM

        llm = LLM(
            model=model,
            dtype=dtype,
            max_model_len=max_seq_len,
            max_logprobs=max_top_k,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_prefix_caching=False,  # prompt logprobs need every position computed
            # requests are token ids and answers logprobs of ids: no tokenizer is needed (a
            # model directory without one, e.g. a converted checkpoint, must still serve)
            skip_tokenizer_init=True,
        )
        return cls(llm, model_name=name, max_top_k=max_top_k)

    def close(self) -> None:
        """Shut vLLM's engine core down. It is a separate process holding the GPU memory vLLM
        took; without this a stopped service left it running (seen on an H200: two stopped
        teachers' engine cores still held 42 GiB each)."""
        shutdown_llm(self.llm)

    def check_temperature(self, temperature: float) -> str | None:
        if temperature != 1.0:
            return (
                "the vllm engine scores at temperature 1.0 only (vLLM's prompt_logprobs ignore "
                "the sampling temperature); use the transformers engine for other temperatures"
            )
        return None

    def score(self, jobs: list[ScoreJob]) -> list[Scores]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not jobs:
            return []
        prompts = [TokensPrompt(prompt_token_ids=j.tokens.tolist()) for j in jobs]
        params = [
            SamplingParams(
                max_tokens=1, temperature=1.0, prompt_logprobs=max(j.top_k, 1), detokenize=False
            )
            for j in jobs
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [_scores(j, out.prompt_logprobs) for j, out in zip(jobs, outputs, strict=True)]


def shutdown_llm(llm: Any) -> None:
    """Stop the engine core process of a ``vllm.LLM`` (frees its GPU memory); also used by the
    rollout vllm engine."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None:
        core.shutdown()


def _scores(job: ScoreJob, prompt_logprobs: list[dict[int, Any] | None]) -> Scores:
    """Rows ``prompt_len..len-1`` of vLLM's per-position dicts (entry 0 is None)."""
    n, k = job.scored, job.top_k
    sampled = np.empty(n, dtype=np.float32)
    top_ids = np.full((n, k), -1, dtype=np.int32)
    top_lps = np.full((n, k), -math.inf, dtype=np.float32)
    for r, p in enumerate(range(job.prompt_len, len(job.tokens))):
        sampled[r], ranked = ranked_entries(prompt_logprobs[p], int(job.tokens[p]), k, p)
        for c, (tid, logprob) in enumerate(ranked):
            top_ids[r, c] = tid
            top_lps[r, c] = logprob
    return Scores(sampled=sampled, top_ids=top_ids, top_logprobs=top_lps)


def ranked_entries(
    entries: dict[int, Any] | None, token: int, k: int, position: int
) -> tuple[float, list[tuple[int, float]]]:
    """One position of vLLM's ``prompt_logprobs``: the logprob of ``token`` (the one that came
    next) and the ``k`` most likely ``(id, logprob)``, most likely first (also used by the
    rollout vllm engine's ``score``)."""
    if entries is None:
        raise RuntimeError(f"vLLM returned no prompt logprobs at position {position}")
    ranked = sorted(
        ((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank <= k),
        key=lambda e: e[0],
    )[:k]
    return float(entries[token].logprob), [(int(t), float(lp)) for _, t, lp in ranked]
