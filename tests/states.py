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
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]
        bits = t.view(width).clone()
        mask = torch.rand(bits.shape, generator=g) < density
        step = torch.randint(-3, 4, bits.shape, generator=g).to(bits.dtype)
        step[step == 0] = 1
        bits[mask] += step[mask]
        out[name] = bits.view(t.dtype)
    return out


def mixed_fused_state(seed: int = 0, n_loose: int = 60) -> dict[str, torch.Tensor]:
    """Many tensors of mixed sizes and all three dtypes, some of them views into fused tensors
    (like vLLM's qkv_proj / gate_up_proj): contiguous slices at element offsets that are not
    16-byte aligned. CPU; :func:`state_to` moves it keeping the views."""
    g = torch.Generator().manual_seed(seed)
    sizes = [*torch.randint(1, 5000, (n_loose,), generator=g).tolist(), 1, 2, 200_003]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    state: dict[str, torch.Tensor] = {}
    for i, n in enumerate(sizes):
        state[f"loose.{i}"] = torch.randn(n, generator=g).to(dtypes[i % 3])
    for dtype, name in ((torch.bfloat16, "qkv"), (torch.float32, "gate_up")):
        fused = torch.randn(3 * 4096 + 5 + 7, generator=g).to(dtype)
        state[f"{name}.a"] = fused[5 : 5 + 4096].view(64, 64)
        state[f"{name}.b"] = fused[5 + 4096 : 5 + 2 * 4096].view(4096)
        state[f"{name}.c"] = fused[5 + 2 * 4096 + 7 :].view(32, 128)
    return state


def state_to(state: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """``state`` on ``device``, views into one fused tensor staying views into its copy."""
    moved: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        base = t._base if t._base is not None else t
        key = id(base)
        if key not in moved:
            moved[key] = base.to(device)
        out[name] = torch.as_strided(moved[key], t.shape, t.stride(), t.storage_offset())
    return out
