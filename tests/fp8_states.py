"""Small model states in block fp8 (weightsync/fp8.py) and optimizer-like steps of
their bf16 master weights, for the fp8 codec, publisher and worker tests."""

from __future__ import annotations

import torch

from deltarl.weightsync import fp8

# edge blocks everywhere (192 = 128 + 64, 320 = 2 x 128 + 64), a router, stacked experts
SHAPES: dict[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (300, 192),
    "model.layers.0.input_layernorm.weight": (192,),
    "model.layers.0.self_attn.q_proj.weight": (192, 192),
    "model.layers.0.self_attn.k_proj.weight": (128, 192),
    "model.layers.0.self_attn.o_proj.weight": (192, 192),
    "model.layers.0.mlp.up_proj.weight": (320, 192),
    "model.layers.0.mlp.down_proj.weight": (192, 320),
    "model.layers.1.mlp.gate.weight": (4, 192),
    "model.layers.1.mlp.experts.gate_up_proj": (4, 256, 192),
    "model.norm.weight": (192,),
    "lm_head.weight": (300, 192),
}


def bf16_model(seed: int = 0, scale: float = 0.02) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in SHAPES.items():
        t = torch.randn(shape, generator=g) * scale
        if len(shape) == 1:
            t = 1.0 + t
        out[name] = t.to(torch.bfloat16)
    return out


def adam_like_step(
    master: dict[str, torch.Tensor], lr: float, seed: int
) -> dict[str, torch.Tensor]:
    """fp32 master weights moved by about ``lr`` each (Adam's normalized step), in place;
    returns their bf16 cast (what the trainer publishes)."""
    g = torch.Generator().manual_seed(seed)
    for t in master.values():
        t.add_(torch.randn(t.shape, generator=g).sign() * lr)
    return {n: t.to(torch.bfloat16) for n, t in master.items()}


def fp8_versions(n: int, lr: float = 3e-4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` consecutive fp8 states of one training run (version 0 first)."""
    master = {k: v.float() for k, v in bf16_model(seed).items()}
    out = [fp8.quantize_state({k: v.to(torch.bfloat16) for k, v in master.items()})]
    for i in range(1, n):
        out.append(fp8.quantize_state(adam_like_step(master, lr, seed * 1000 + i)))
    return out


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (any dtype), for bit-exact comparisons."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k]))
        for k in a
    )
