"""A fake engine holding block-fp8 weights the way vLLM 0.33 does on Hopper (CUTLASS block
kernels), for the fp8 worker tests on CPU.

vLLM's runtime parameters, per layer: ``qkv_proj.weight`` e4m3 ``[q + 2 kv, d]`` with
``qkv_proj.weight_scale_inv`` float32 ``[(q + 2 kv) / 128, d / 128]`` (q, k, v row blocks; their
scales' block rows in the same order), ``gate_up_proj`` likewise, ``o_proj``/``down_proj`` whole;
a mixture-of-experts layer holds ``experts.w13_weight`` e4m3 ``[E, 2 I, H]`` with
``w13_weight_scale_inv`` ``[E, 2 I / 128, H / 128]`` and ``w2_*`` and a bf16 router; embeddings,
LM head and norms stay bf16 (vocabulary padded to 64 rows). The loader is written in vLLM's
style for the test (narrow the fused parameter, ``copy_`` the checkpoint tensor), so the real
probe (``vllm_mapping.probe_views``) maps every checkpoint tensor, e4m3 and scales included, to
a view of those parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from rollout_helpers import put_param

from deltarl.rollout.engines.base import (
    UNMANAGED,
    Completion,
    Engine,
    EngineType,
    SamplingParams,
    WeightsGate,
    WeightsStamp,
)
from deltarl.rollout.engines.vllm_mapping import fp8_specs, probe_views, specs_of

D, Q, KV, INTER, VOCAB, EXPERTS, MOE_INTER = 256, 256, 128, 384, 300, 4, 128
FUSED = {  # checkpoint piece -> (fused runtime piece, row offset, rows)
    ".q_proj.": (".qkv_proj.", 0, Q),
    ".k_proj.": (".qkv_proj.", Q, KV),
    ".v_proj.": (".qkv_proj.", Q + KV, KV),
    ".gate_proj.": (".gate_up_proj.", 0, INTER),
    ".up_proj.": (".gate_up_proj.", INTER, INTER),
}
EXPERT_NAMES = {
    ".experts.gate_up_proj": ".experts.w13_weight",
    ".experts.down_proj": ".experts.w2_weight",
}


def master_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 master weights of a two-layer model (a dense MLP, then a mixture of experts), with
    Hugging Face (transformers 5) names."""
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, D)}
    for i in range(2):
        pre = f"model.layers.{i}"
        shapes |= {
            f"{pre}.input_layernorm.weight": (D,),
            f"{pre}.self_attn.q_proj.weight": (Q, D),
            f"{pre}.self_attn.k_proj.weight": (KV, D),
            f"{pre}.self_attn.v_proj.weight": (KV, D),
            f"{pre}.self_attn.o_proj.weight": (D, Q),
            f"{pre}.post_attention_layernorm.weight": (D,),
        }
    shapes |= {
        "model.layers.0.mlp.gate_proj.weight": (INTER, D),
        "model.layers.0.mlp.up_proj.weight": (INTER, D),
        "model.layers.0.mlp.down_proj.weight": (D, INTER),
        "model.layers.1.mlp.gate.weight": (EXPERTS, D),
        "model.layers.1.mlp.experts.gate_up_proj": (EXPERTS, 2 * MOE_INTER, D),
        "model.layers.1.mlp.experts.down_proj": (EXPERTS, D, MOE_INTER),
        "model.norm.weight": (D,),
        "lm_head.weight": (VOCAB, D),
    }
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g) * 0.02
        out[name] = 1.0 + t if len(shape) == 1 else t
    return out


class FusedFp8Model(torch.nn.Module):
    """vLLM's runtime layout of :func:`master_weights` in block fp8, random bytes at first
    (``load_format="dummy"``)."""

    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def e4m3(*shape: int) -> torch.nn.Parameter:
            raw = torch.randint(0, 0x7E, shape, generator=g, dtype=torch.uint8)
            return torch.nn.Parameter(raw.view(torch.float8_e4m3fn), False)

        def f32(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.rand(shape, generator=g), False)

        def bf16(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(shape, generator=g).to(torch.bfloat16), False)

        def linear(name: str, rows: int, cols: int) -> None:
            put_param(self, f"{name}.weight", e4m3(rows, cols))
            put_param(self, f"{name}.weight_scale_inv", f32(-(-rows // 128), -(-cols // 128)))

        padded = -(-VOCAB // 64) * 64
        put_param(self, "model.embed_tokens.weight", bf16(padded, D))
        for i in range(2):
            pre = f"model.layers.{i}"
            put_param(self, f"{pre}.input_layernorm.weight", bf16(D))
            put_param(self, f"{pre}.post_attention_layernorm.weight", bf16(D))
            linear(f"{pre}.self_attn.qkv_proj", Q + 2 * KV, D)
            linear(f"{pre}.self_attn.o_proj", D, Q)
        linear("model.layers.0.mlp.gate_up_proj", 2 * INTER, D)
        linear("model.layers.0.mlp.down_proj", D, INTER)
        put_param(self, "model.layers.1.mlp.gate.weight", bf16(EXPERTS, D))
        experts = "model.layers.1.mlp.experts"
        put_param(self, f"{experts}.w13_weight", e4m3(EXPERTS, 2 * MOE_INTER, D))
        put_param(self, f"{experts}.w13_weight_scale_inv", f32(EXPERTS, 2 * MOE_INTER // 128, 2))
        put_param(self, f"{experts}.w2_weight", e4m3(EXPERTS, D, MOE_INTER))
        put_param(self, f"{experts}.w2_weight_scale_inv", f32(EXPERTS, 2, 1))
        put_param(self, "model.norm.weight", bf16(D))
        put_param(self, "lm_head.weight", bf16(padded, D))

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, w in weights:
            for piece, (fused, offset, rows) in FUSED.items():
                if piece in name:
                    target = name.replace(piece, fused)
                    if name.endswith("_scale_inv"):  # block rows of the scales
                        offset, rows = offset // 128, -(-rows // 128)
                    self.get_parameter(target).data.narrow(0, offset, rows).copy_(w)
                    break
            else:
                target = name
                for piece, runtime in EXPERT_NAMES.items():
                    target = target.replace(piece, runtime)
                param = self.get_parameter(target)
                if "embed_tokens" in name or "lm_head" in name:
                    param.data[: w.shape[0]].copy_(w)
                    param.data[w.shape[0] :].fill_(0)
                else:
                    param.data.copy_(w)
            loaded.add(target)
        return loaded


class FakeFp8Engine(Engine):
    """An engine whose weights are a :class:`FusedFp8Model` seen through the probe's views
    (Hugging Face names, e4m3 and scale tensors as the trainer publishes them); ``generate``
    runs ``steps`` gated forward steps and samples nothing real."""

    type: ClassVar[EngineType] = "vllm"

    def __init__(self, model: FusedFp8Model | None = None, steps: int = 2) -> None:
        self.model = model if model is not None else FusedFp8Model()
        bf16 = {n: t.to(torch.bfloat16) for n, t in master_weights().items()}
        self.specs = fp8_specs(specs_of(bf16))
        self.views = probe_views(self.model, self.specs)
        self.steps = steps

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def named_parameters(self) -> Mapping[str, torch.Tensor]:
        return self.views

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        gate: WeightsGate | None = None,
    ) -> list[Completion]:
        stamps: list[WeightsStamp] = []
        for _ in range(self.steps):
            with _entered(gate) as stamp:
                stamps.append(stamp)
        return [Completion([1] * self.steps, [0.0] * self.steps, "length", stamps[0], stamps[-1])
                for _ in prompts]  # fmt: skip


@contextmanager
def _entered(gate: WeightsGate | None) -> Iterator[WeightsStamp]:
    if gate is None:
        yield UNMANAGED
        return
    with gate.forward() as stamp:
        yield stamp
