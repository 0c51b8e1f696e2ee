"""Small random model states in every supported dtype, and optimizer-like perturbations of them."""

from __future__ import annotations

import torch


def make_state(
    seed: int = 0, dtype: torch.dtype = torch.bfloat16, scale: float = 0.02
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (64, 48),
        "layer.0.proj.weight": (48, 96),
        "layer.0.norm.weight": (48,),
        "head.bias": (7,),
    }
    return {n: (torch.randn(s, generator=g) * scale).to(dtype) for n, s in shapes.items()}


def perturb(
    state: dict[str, torch.Tensor], density: float, seed: int = 1
) -> dict[str, torch.Tensor]:
    """A new state where about ``density`` of the elements moved by a few ULPs (like an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        bits = t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()
        mask = torch.rand(bits.shape, generator=g) < density
        step = torch.randint(-3, 4, bits.shape, generator=g).to(bits.dtype)
        step[step == 0] = 1
        bits[mask] += step[mask]
        out[name] = bits.view(t.dtype)
    return out
