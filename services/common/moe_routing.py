"""Routing replay for mixture-of-experts models: record which experts each token's router picked
where the tokens were sampled, and make the trainer's forward use the same experts.

Why: a mixture-of-experts layer sends each token to the ``top_k`` experts its router scores
highest. The trainer and the inference engine compute the router's scores with different kernels,
so where two experts score almost alike they can pick different ones, and that token's hidden
state (and every later token's) then differs by a whole expert's output: the logprob gap between
trainer and engine on MoE models is several times that of dense ones. Replaying the engine's
choices in the trainer's forward (vLLM's ``enable_return_routed_experts``, "R3") removes that
source of mismatch; the gate weights of the replayed experts are still the trainer's own softmax,
so the router keeps its gradient.

Layout of a routing record: ``[rows, layers, top_k]`` expert ids, row ``t`` for the token at
position ``t`` of the sequence, ``layers`` the model's MoE layers in forward order (what
:func:`routers` lists). A sequence of ``n`` tokens has ``n - 1`` rows: the last token is never
fed to the model where it was sampled.

Supported routers: softmax top-k routers that return ``(logits, scores, indices)`` (transformers'
Qwen2-MoE and Qwen3-MoE, the layout of Qwen3-30B-A3B and Qwen3-235B-A22B). Others raise
:class:`UnsupportedRoutingError` naming the class, rather than replaying something else.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "SUPPORTED_ROUTERS",
    "RoutingRecorder",
    "UnsupportedRoutingError",
    "replay_routing",
    "routers",
]

SUPPORTED_ROUTERS = frozenset({"Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter"})
"""Router classes whose forward this module records and replays (softmax, top-k, optional
renormalisation of the top-k probabilities)."""


class UnsupportedRoutingError(ValueError):
    """The model routes through a router class that routing replay does not know."""


def _is_router(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith(("TopKRouter", "TopkRouter"))


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in forward order (empty for a dense model); raises
    :class:`UnsupportedRoutingError` if one is of a class not in :data:`SUPPORTED_ROUTERS`."""
    found = [m for m in model.modules() if _is_router(m)]
    # FSDP2's fully_shard renames a module's class FSDP<name>
    bad = sorted({type(m).__name__.removeprefix("FSDP") for m in found} - SUPPORTED_ROUTERS)
    if bad:
        raise UnsupportedRoutingError(
            f"routing replay supports {sorted(SUPPORTED_ROUTERS)}; this model routes with {bad}"
        )
    return found


class RoutingRecorder:
    """Records the expert ids every router picks, call by call (a forward hook per router).

    ``with RoutingRecorder(model) as rec: model(...)`` then ``rec.calls`` holds, for each forward
    call, a ``[tokens, layers, top_k]`` int64 CPU tensor in the order the model flattened its
    input (``[B, T]`` row-major). Calls without routers record nothing (``rec.layers == 0``).
    Only the thread that entered the block is recorded: a forward another thread runs on the
    same model meanwhile (the engine scoring a hint while it generates) is not.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._routers = routers(model)
        self._hooks: list[Any] = []
        self._pending: list[torch.Tensor | None] = [None] * len(self._routers)
        self._owner = 0  # the recording thread
        self.calls: list[torch.Tensor] = []

    @property
    def layers(self) -> int:
        return len(self._routers)

    def __enter__(self) -> RoutingRecorder:
        self._owner = threading.get_ident()
        for i, router in enumerate(self._routers):
            self._hooks.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _hook(self, layer: int) -> Any:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            if threading.get_ident() != self._owner:
                return
            self._pending[layer] = output[2].detach()
            if layer == len(self._routers) - 1:  # the last MoE layer ends the call
                self.flush()

        return hook

    def flush(self) -> None:
        """Close the current call (the last layer's hook does this by itself)."""
        if any(p is None for p in self._pending):
            self._pending = [None] * len(self._routers)
            return
        self.calls.append(torch.stack(self._pending, dim=1).to("cpu", torch.int64))  # type: ignore[arg-type]
        self._pending = [None] * len(self._routers)


def _replaying_forward(router: Any, forced: torch.Tensor) -> Any:
    """A forward for ``router`` that picks ``forced`` [N, top_k] experts where they are >= 0
    (rows of -1: the router's own top-k), with the router's own probabilities as their scores."""

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(h, router.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        if forced.shape != own.shape:
            raise ValueError(
                f"routing replay: {tuple(forced.shape)} expert ids for a forward of "
                f"{own.shape[0]} tokens x top_k {router.top_k}"
            )
        f = forced.to(own.device)
        index = torch.where(f[:, :1] >= 0, f, own)
        scores = probs.gather(-1, index)
        if router.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return logits, scores.to(logits.dtype), index

    return forward


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, experts: torch.Tensor | None) -> Iterator[None]:
    """Within the block, the model's routers pick ``experts`` ([B, T, layers, top_k] int64; a
    row of -1: the router's own choice) for the next forward's ``[B, T]`` tokens. ``None``: no
    replay (the block runs unchanged). Gradients reach the router through the replayed experts'
    probabilities."""
    if experts is None:
        yield
        return
    found = routers(model)
    if experts.dim() != 4 or experts.shape[2] != len(found):
        raise ValueError(
            f"routing replay: expert ids of shape {tuple(experts.shape)} for a model with "
            f"{len(found)} MoE layers (want [batch, tokens, {len(found)}, top_k])"
        )
    flat = experts.reshape(-1, experts.shape[2], experts.shape[3])
    patched = []
    try:
        for layer, router in enumerate(found):
            if flat.shape[-1] != int(router.top_k):  # type: ignore[arg-type]
                raise ValueError(
                    f"routing replay: top_k {flat.shape[-1]} recorded, the model's router "
                    f"picks {router.top_k}"
                )
            router.forward = _replaying_forward(router, flat[:, layer])
            patched.append(router)
        yield
    finally:
        for router in patched:
            del router.forward  # the class's forward again
