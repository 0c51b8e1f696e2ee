"""What a model publishes (weightsync/model_state.py): tensors, tied ones once, on any
device (meta included), and the ones transformers keeps in fp32."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

from deltarl.weightsync.model_state import fp32_names, publish_dtype, publishable_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from moe_helpers import deepseek_v3_config, qwen3_moe_config


def llama(tied: bool) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        tie_word_embeddings=tied,
    )


def test_tied_weights_once_on_every_device() -> None:
    for tied in (False, True):
        real = transformers.LlamaForCausalLM(llama(tied))
        with torch.device("meta"):  # no storage: data_ptr() is 0 for every tensor
            meta = transformers.LlamaForCausalLM(llama(tied))
        names = list(publishable_state(real))
        assert names == list(publishable_state(meta)) == [n for n, _ in real.named_parameters()]
        assert ("lm_head.weight" in names) is not tied


def test_float_buffers_and_the_fp32_router() -> None:
    with torch.device("meta"):
        deepseek = transformers.AutoModelForCausalLM.from_config(
            deepseek_v3_config(), dtype=torch.bfloat16
        )
        qwen = transformers.AutoModelForCausalLM.from_config(
            qwen3_moe_config(), dtype=torch.bfloat16
        )
    state = publishable_state(deepseek)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert bias in state and bias not in dict(deepseek.named_parameters())  # a buffer
    keep = fp32_names(deepseek, torch.bfloat16)
    assert keep == {bias, "model.layers.1.mlp.gate.weight"}
    assert all(state[n].dtype == torch.float32 for n in keep)  # as transformers builds it
    assert fp32_names(deepseek, torch.float32) == frozenset()
    assert fp32_names(qwen, torch.bfloat16) == frozenset()  # Qwen3-MoE's router is bf16
    bf16 = torch.bfloat16
    assert publish_dtype("model.layers.1.mlp.gate.weight[2:4]", bf16, keep) == torch.float32
    assert publish_dtype("model.layers.1.mlp.gate.weight", bf16, keep) == torch.float32
    assert publish_dtype("model.norm.weight[0:8]", bf16, keep) == bf16
