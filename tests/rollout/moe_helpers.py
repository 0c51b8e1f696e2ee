"""Tiny mixture-of-experts models for the rollout tests: Hugging Face configs (Qwen3-MoE, and
DeepSeek-V3 with shared experts), their states, and one rank of vLLM 0.33's runtime layout with
a loader in vLLM's style (written for the tests from vLLM 0.33's source, not copied).

vLLM 0.33 (``model_executor/layers/fused_moe/routed_experts.py``) holds a MoE layer's routed
experts stacked: ``mlp.experts.routed_experts.w13_weight`` ``[E_local, 2 * I_local, H]`` (per
expert its gate rows, then its up rows) and ``w2_weight`` ``[E_local, H, I_local]``; the router
``mlp.gate.weight`` ``[E, H]`` is replicated. Its loader takes per-expert checkpoint names
(``mlp.experts.{e}.gate_proj.weight`` ...) or the stacked names transformers 5 holds
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``), which
it splits with ``chunk(2, dim=1)`` (gate, up) and ``unbind()`` (experts) and hands to the
per-expert ``weight_loader``: under tensor parallelism each rank keeps rows
``[r * I_local, (r + 1) * I_local)`` of every expert's gate and up (and those columns of
down); under expert parallelism (``enable_expert_parallel``, linear placement) rank ``r``
keeps experts ``[r * E / n, (r + 1) * E / n)`` whole and skips the others (its MoE tensor
parallel size is 1). The rest is laid out as vLLM's Llama in ``test_vllm_shards.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import transformers

from deltarl.weightsync.model_state import publishable_state

VOCAB = 100  # padded to 128 in the vLLM-shaped models


def qwen3_moe_config(
    *,
    layers: int = 2,
    experts: int = 4,
    top_k: int = 2,
    hidden: int = 32,
    moe_inter: int = 16,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = VOCAB,
    tied: bool = False,
) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=moe_inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )


def deepseek_v3_config(
    *, layers: int = 2, experts: int = 4, top_k: int = 2, vocab: int = VOCAB
) -> transformers.DeepseekV3Config:
    """Layer 0 dense (``first_k_dense_replace``), the others MoE with one shared expert;
    multi-head latent attention with small ranks."""
    return transformers.DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=top_k,
        n_group=1,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def hf_moe_model(config: Any, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Any:
    """The Hugging Face model of ``config`` in ``dtype`` as transformers builds it (a router the
    model keeps in fp32 stays fp32), random weights of ``seed``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # a router at zero (its init) routes every token alike
        for name, t in publishable_state(model).items():
            if name.endswith("mlp.gate.weight"):
                t.normal_(0.0, 0.5)
    return model


def moe_state(config: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """What the trainer publishes for ``config``: names, shapes and dtypes (bf16; fp32 where
    the model keeps fp32), cloned."""
    return {n: t.detach().clone() for n, t in publishable_state(hf_moe_model(config, seed)).items()}


def perturb_experts(
    state: dict[str, torch.Tensor], seed: int, *, density: float = 0.01, routed: int = 2
) -> dict[str, torch.Tensor]:
    """An MoE-like optimizer step: ``density`` of every tensor moves by a few ULPs, except the
    stacked expert tensors, of which only ``routed`` experts per layer (drawn at random) move
    (with 10x the density): the shape of a step where only routed experts got a gradient."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        int_t = torch.int16 if t.element_size() == 2 else torch.int32
        bits = t.view(int_t).clone()
        mask = torch.rand(bits.shape, generator=g) < density
        if t.dim() == 3 and ".experts." in name:
            mask = torch.rand(bits.shape, generator=g) < min(1.0, 10 * density)
            keep = torch.zeros(t.shape[0], dtype=torch.bool)
            keep[torch.randperm(t.shape[0], generator=g)[:routed]] = True
            mask &= keep[:, None, None]
        step = torch.randint(1, 4, bits.shape, generator=g).to(int_t)
        bits[mask] += step[mask]
        out[name] = bits.view(t.dtype)
    return out


def put(root: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, param)


class VllmMoeRank(torch.nn.Module):
    """Rank ``rank`` of ``tp`` of vLLM 0.33's Qwen3-MoE or DeepSeek-V3 with random weights
    (``load_format="dummy"``). ``ep``: expert parallelism (experts split over the ranks, each
    whole). DeepSeek-V3 as vLLM 0.33 holds it: the router ``mlp.gate.weight`` in the model's
    dtype (``router_dtype``), its bias ``e_score_correction_bias`` in fp32 (``bias_dtype``),
    shared experts as a
    fused ``gate_up_proj``, MLA's ``fused_qkv_a_proj`` and, unless ``derived=False``, the
    absorbed ``W_UK_T``/``W_UV`` that vLLM computes from ``kv_b_proj`` after loading.
    ``transposed``: a fused checkpoint stored ``[E, H, 2I]`` (vLLM's
    ``is_fused_checkpoint_transposed``: the loader transposes it). ``moe_backend``: the value of
    vLLM's ``UnquantizedMoeBackend`` the experts' ``quant_method`` names (Triton on Hopper)."""

    def __init__(
        self,
        cfg: Any,
        tp: int = 1,
        rank: int = 0,
        *,
        ep: bool = False,
        seed: int = 11,
        router_dtype: torch.dtype = torch.bfloat16,
        bias_dtype: torch.dtype = torch.float32,
        derived: bool = True,
        transposed: bool = False,
        moe_backend: str = "TRITON",
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed + rank)
        self.cfg, self.tp, self.rank, self.ep, self.transposed = cfg, tp, rank, ep, transposed
        self.deepseek = cfg.model_type == "deepseek_v3"
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        d = cfg.hidden_size
        experts = cfg.n_routed_experts if self.deepseek else cfg.num_experts
        self.experts = experts
        # MoE placement: EP splits experts over ranks (MoE tensor parallelism off), else TP
        self.moe_tp, self.moe_rank = (1, 0) if ep else (tp, rank)
        ep_size, ep_rank = (tp, rank) if ep else (1, 0)
        base, rem = divmod(experts, ep_size)
        self.local_experts = base + (1 if ep_rank < rem else 0)
        self.first_expert = ep_rank * base + min(ep_rank, rem)
        self.inter = cfg.moe_intermediate_size // self.moe_tp
        padded = -(-cfg.vocab_size // 64) * 64
        self.per_rank = padded // tp
        start = rank * self.per_rank
        self.vocab_rows = (start, max(0, min(start + self.per_rank, cfg.vocab_size) - start))

        def p(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype), False)

        put(self, "model.embed_tokens.weight", p(self.per_rank, d))
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}"
            if self.deepseek:
                self._mla(pre, p)
            else:
                hd = cfg.head_dim
                self.q = cfg.num_attention_heads * hd // tp
                self.kv = max(1, cfg.num_key_value_heads // tp) * hd
                put(self, f"{pre}.self_attn.qkv_proj.weight", p(self.q + 2 * self.kv, d))
                put(self, f"{pre}.self_attn.o_proj.weight", p(d, self.q))
                put(self, f"{pre}.self_attn.q_norm.weight", p(hd))
                put(self, f"{pre}.self_attn.k_norm.weight", p(hd))
            if self.deepseek and i < cfg.first_k_dense_replace:
                dense = cfg.intermediate_size // tp
                put(self, f"{pre}.mlp.gate_up_proj.weight", p(2 * dense, d))
                put(self, f"{pre}.mlp.down_proj.weight", p(d, dense))
            else:
                put(self, f"{pre}.mlp.gate.weight", p(experts, d, dtype=router_dtype))
                moe = f"{pre}.mlp.experts.routed_experts"
                put(self, f"{moe}.w13_weight", p(self.local_experts, 2 * self.inter, d))
                put(self, f"{moe}.w2_weight", p(self.local_experts, d, self.inter))
                # UnquantizedFusedMoEMethod.unquantized_backend (an enum; its value)
                backend = SimpleNamespace(value=moe_backend)
                self.get_submodule(moe).quant_method = SimpleNamespace(unquantized_backend=backend)
                if self.deepseek:
                    put(
                        self,
                        f"{pre}.mlp.gate.e_score_correction_bias",
                        p(experts, dtype=bias_dtype),
                    )
                    shared = cfg.moe_intermediate_size * cfg.n_shared_experts // tp
                    put(self, f"{pre}.mlp.shared_experts.gate_up_proj.weight", p(2 * shared, d))
                    put(self, f"{pre}.mlp.shared_experts.down_proj.weight", p(d, shared))
            put(self, f"{pre}.input_layernorm.weight", p(d))
            put(self, f"{pre}.post_attention_layernorm.weight", p(d))
            if self.deepseek and derived:
                heads = cfg.num_attention_heads // tp
                rank_kv = cfg.kv_lora_rank
                put(
                    self,
                    f"{pre}.self_attn.mla_attn.W_UK_T",
                    p(heads, cfg.qk_nope_head_dim, rank_kv),
                )
                put(self, f"{pre}.self_attn.mla_attn.W_UV", p(heads, rank_kv, cfg.v_head_dim))
        put(self, "model.norm.weight", p(d))
        if self.tied:
            put(self, "lm_head.weight", self.get_parameter("model.embed_tokens.weight"))
        else:
            put(self, "lm_head.weight", p(self.per_rank, d))

    def _mla(self, pre: str, p: Any) -> None:
        cfg, tp, d = self.cfg, self.tp, self.cfg.hidden_size
        heads = cfg.num_attention_heads // tp
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        put(self, f"{pre}.self_attn.fused_qkv_a_proj.weight", p(cfg.q_lora_rank + kv_a, d))
        put(self, f"{pre}.self_attn.q_a_layernorm.weight", p(cfg.q_lora_rank))
        put(self, f"{pre}.self_attn.q_b_proj.weight", p(heads * qk, cfg.q_lora_rank))
        put(self, f"{pre}.self_attn.kv_a_layernorm.weight", p(cfg.kv_lora_rank))
        kv_b = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        put(self, f"{pre}.self_attn.kv_b_proj.weight", p(kv_b, cfg.kv_lora_rank))
        put(self, f"{pre}.self_attn.o_proj.weight", p(d, heads * cfg.v_head_dim))

    # ---------------------------------------------------------------- the loader

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, w in weights:
            if self.tied and name.startswith("lm_head."):
                continue
            if ".mlp.experts." in name:
                loaded |= self._load_experts(name, w)
                continue
            target = self._load_dense(name, w)
            loaded.add(target)
        return loaded

    def _rows(self, name: str, w: torch.Tensor, at: int = 0) -> str:
        """Column parallel: this rank's rows of ``w`` into rows ``at..`` of ``name``."""
        param = self.get_parameter(name).data
        size = w.shape[0] // self.tp
        param.narrow(0, at, size).copy_(w.narrow(0, self.rank * size, size))
        return name

    def _load_dense(self, name: str, w: torch.Tensor) -> str:
        r = self.rank
        parent, _, leaf = name.rpartition(".")
        module = parent.rpartition(".")[2]
        base = parent.rpartition(".")[0]
        if module in ("q_proj", "k_proj", "v_proj"):
            target = f"{base}.qkv_proj.{leaf}"
            param = self.get_parameter(target).data
            if module == "q_proj":
                param.narrow(0, 0, self.q).copy_(w.narrow(0, r * self.q, self.q))
            else:
                heads = self.cfg.num_key_value_heads
                head = r // max(1, self.tp // heads)
                at = self.q if module == "k_proj" else self.q + self.kv
                param.narrow(0, at, self.kv).copy_(w.narrow(0, head * self.kv, self.kv))
            return target
        if module in ("gate_proj", "up_proj"):  # dense or shared-expert MLP: merged column
            target = f"{base}.gate_up_proj.{leaf}"
            half = self.get_parameter(target).shape[0] // 2
            return self._rows(target, w, 0 if module == "gate_proj" else half)
        if module in ("q_a_proj", "kv_a_proj_with_mqa"):  # replicated, fused
            target = f"{base}.fused_qkv_a_proj.{leaf}"
            at = 0 if module == "q_a_proj" else self.cfg.q_lora_rank
            self.get_parameter(target).data.narrow(0, at, w.shape[0]).copy_(w)
            return target
        if module in ("q_b_proj", "kv_b_proj"):
            return self._rows(name, w)
        if module in ("o_proj", "down_proj"):  # row parallel: input columns
            param = self.get_parameter(name).data
            k = param.shape[1]
            param.copy_(w.narrow(1, r * k, k))
            return name
        if module in ("embed_tokens", "lm_head"):
            param = self.get_parameter(name).data
            start, size = self.vocab_rows
            param[:size].copy_(w.narrow(0, start, size))
            param[size:].fill_(0)
            return name
        self.get_parameter(name).data.copy_(w)  # norms, router, router bias: replicated
        return name

    def _load_experts(self, name: str, w: torch.Tensor) -> set[str]:
        """``RoutedExperts.load_weights`` of vLLM 0.33 for one checkpoint tensor."""
        layer, _, rest = name.partition(".mlp.experts.")
        moe = f"{layer}.mlp.experts.routed_experts"
        w13, w2 = self.get_parameter(f"{moe}.w13_weight"), self.get_parameter(f"{moe}.w2_weight")
        if rest in ("gate_up_proj", "down_proj"):  # a stacked (fused) checkpoint tensor
            fused = w.transpose(-1, -2) if self.transposed else w
            if rest == "gate_up_proj":
                for chunk, shard_id in enumerate(("w1", "w3")):
                    for e, piece in enumerate(fused.chunk(2, dim=1)[chunk].unbind()):
                        self._weight_loader(w13, piece, shard_id, e)
                return {f"{moe}.w13_weight"}
            for e, piece in enumerate(fused.unbind()):
                self._weight_loader(w2, piece, "w2", e)
            return {f"{moe}.w2_weight"}
        expert, proj, _ = rest.split(".")  # per expert: "{e}.gate_proj.weight"
        shard_id = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
        param = w2 if shard_id == "w2" else w13
        for e, piece in enumerate(w.unsqueeze(0).unbind(), start=int(expert)):
            self._weight_loader(param, piece, shard_id, e)
        return {f"{moe}.{'w2' if shard_id == 'w2' else 'w13'}_weight"}

    def _weight_loader(
        self, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: str, expert: int
    ) -> None:
        """``RoutedExperts.weight_loader`` -> ``_load_w13`` / ``_load_w2`` (unquantized)."""
        local = expert - self.first_expert
        if not 0 <= local < self.local_experts:
            return  # not this rank's expert (expert parallelism)
        expert_data = param.data[local]
        if shard_id == "w2":  # row parallel: input columns
            per = loaded.shape[1] // self.moe_tp
            expert_data.copy_(loaded.narrow(1, per * self.moe_rank, per))
            return
        shard_size = expert_data.shape[0] // 2
        per = loaded.shape[0] // self.moe_tp
        loaded = loaded.narrow(0, per * self.moe_rank, per)
        at = 0 if shard_id == "w1" else shard_size
        expert_data.narrow(0, at, shard_size).copy_(loaded)


def rank_models(cfg: Any, tp: int, *, ep: bool = False, seed: int = 11, **kw: Any) -> list[Any]:
    return [VllmMoeRank(cfg, tp, r, ep=ep, seed=seed, **kw) for r in range(tp)]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32)

    return set(a) == set(b) and all(torch.equal(bits(a[n]), bits(b[n])) for n in a)
