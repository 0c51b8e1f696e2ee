"""``upcycle``: a dense Llama becomes a Qwen2-MoE (the ``smollm2-moe`` model kind) that computes
the dense model's function when its experts are exact copies, and a different one (experts that
routing tells apart) with noise; everything but the MLPs is copied as it is."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from deltarl.services.common.models import upcycle  # noqa: E402


@pytest.fixture
def dense() -> object:
    """A random dense Llama on the bf16 grid (transformers' Qwen2-MoE imported here: its
    first import is most of a test's time)."""
    assert transformers.Qwen2MoeForCausalLM is not None
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # on the bf16 grid, as the upcycled copy will be
        for p in dense.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return dense


def _logits(model: object, ids: object) -> object:
    with torch.no_grad():
        return model(ids).logits.float()  # type: ignore[operator]


def test_exact_copies_compute_the_dense_model(dense: object) -> None:
    moe = upcycle(dense, experts=4, top_k=2, noise=0.0, seed=1)
    assert moe.dtype == torch.bfloat16
    cfg = moe.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, True)
    state = moe.state_dict()
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (4, 2 * 96, 64)
    src = dense.state_dict()  # type: ignore[attr-defined]
    want = torch.cat(
        [src["model.layers.1.mlp.gate_proj.weight"], src["model.layers.1.mlp.up_proj.weight"]]
    )
    for e in range(4):
        assert torch.equal(gate_up[e].float(), want)
    assert torch.equal(
        state["model.layers.0.self_attn.q_proj.weight"].float(),
        src["model.layers.0.self_attn.q_proj.weight"],
    )
    assert not state["model.layers.0.self_attn.k_proj.bias"].any()
    assert not state["model.layers.0.mlp.shared_expert.down_proj.weight"].any()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    diff = (_logits(moe.float(), ids) - _logits(dense, ids)).abs().max().item()
    assert diff < 1e-4


def test_noise_makes_experts_differ_and_routing_matter(dense: object) -> None:
    moe = upcycle(dense, experts=4, top_k=2, noise=0.2, seed=1).float()
    down = moe.state_dict()["model.layers.0.mlp.experts.down_proj"]
    assert not torch.equal(down[0], down[1])
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    assert (_logits(moe, ids) - _logits(dense, ids)).abs().max().item() > 1e-3
    again = upcycle(dense, experts=4, top_k=2, noise=0.2, seed=1).float()
    assert torch.equal(again.state_dict()["model.layers.0.mlp.experts.down_proj"], down)


def test_refuses_a_dense_model_with_biases(dense: object) -> None:
    dense.config.attention_bias = True  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="biases"):
        upcycle(dense, experts=2, top_k=1, noise=0.0, seed=0)
