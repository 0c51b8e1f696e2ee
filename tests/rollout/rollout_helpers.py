"""Helpers for rollout tests: a tiny random Llama and a fake trainer publishing versions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.engines.transformers_engine import TransformersEngine
from deltarl.weightsync.anchor import encode_anchor
from deltarl.weightsync.codec.formats import FORMAT_TAGS, encode_delta
from deltarl.weightsync.delta import compute_delta
from deltarl.weightsync.digest import state_digest
from deltarl.weightsync.signing import Signer
from deltarl.weightsync.writer import BucketWriter, NewObject


def tiny_config(layers: int = 2, *, tied: bool = False) -> transformers.LlamaConfig:
    kwargs: dict[str, Any] = {"attn_implementation": "sdpa"}
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        **kwargs,
    )


def tiny_engine(
    seed: int = 0, layers: int = 2, dtype: torch.dtype = torch.bfloat16, *, tied: bool = False
) -> TransformersEngine:
    torch.manual_seed(seed)
    model: torch.nn.Module = transformers.LlamaForCausalLM(tiny_config(layers, tied=tied))
    return TransformersEngine(model.to(dtype), seed=seed)


def clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in state.items()}


def perturb(
    state: dict[str, torch.Tensor], seed: int, density: float = 0.05
) -> dict[str, torch.Tensor]:
    """A new state where about ``density`` of the elements moved by a few ULPs (an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        bits = t.view(torch.int16).clone()
        mask = torch.rand(bits.shape, generator=g) < density
        step = torch.randint(1, 4, bits.shape, generator=g).to(torch.int16)
        bits[mask] += step[mask]
        out[name] = bits.view(t.dtype)
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[n].detach().cpu().view(torch.int16), b[n].detach().cpu().view(torch.int16))
        for n in a
    )


class FakeTrainer:
    """Publishes versions of a state the way the trainer does (anchors + compact deltas)."""

    def __init__(
        self, bucket: LocalBucket, state: dict[str, torch.Tensor], *, signer: Signer | None = None
    ) -> None:
        self.bucket = bucket
        self.publisher = BucketWriter(bucket, anchor_every=0, signer=signer)
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.publish(0, clone_state(state), anchor=True)

    @property
    def latest(self) -> int:
        return max(self.states)

    def publish(
        self,
        version: int,
        state: dict[str, torch.Tensor],
        *,
        anchor: bool = False,
        base: int | None = None,
        encode_from: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Publish ``state`` as ``version``; ``encode_from`` builds the delta blob from another
        state than ``base``'s while declaring ``base`` (a delta whose base does not match)."""
        objects = []
        if anchor:
            objects.append(NewObject("anchor", "safetensors", encode_anchor(state, version)))
        if base is not None:
            old = self.states[base]
            d = compute_delta(old, state, base, version)
            src = encode_from if encode_from is not None else old
            blob = encode_delta(compute_delta(src, state, base, version), src, "compact")
            objects.append(
                NewObject("delta", FORMAT_TAGS["compact"], blob, base, d.base_digest, d.changed)
            )
        numel = sum(t.numel() for t in state.values())
        self.publisher.publish(
            version, objects, state_digest=state_digest(state), numel=numel, full_bytes=2 * numel
        )
        self.states[version] = state

    def step(self, *, anchor: bool = False) -> int:
        v = self.latest + 1
        self.publish(v, perturb(self.states[v - 1], seed=v), anchor=anchor, base=v - 1)
        return v

    def object_path(self, version: int, kind: str) -> Path:
        manifest = self.publisher.reader.manifest(version)
        ref = next(o for o in manifest.objects if o.kind == kind)
        return self.bucket.root / ref.key


def put_param(root: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    """Register ``param`` under the dotted ``name`` (intermediate modules created)."""
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, param)


def fused_llama_params(
    root: torch.nn.Module,
    layers: int,
    *,
    d: int,
    q: int,
    kv: int,
    inter: int,
    vocab_rows: int,
    tied: bool,
    make: Any,
) -> None:
    """Register vLLM Llama's runtime parameters on ``root`` (fused ``qkv_proj`` of ``q + 2 kv``
    rows, ``gate_up_proj`` of ``2 inter``, ``o_proj``/``down_proj`` of ``q``/``inter``
    columns, embedding / LM head of ``vocab_rows`` rows, tied or not); ``make(*shape)`` builds
    each parameter."""
    put_param(root, "model.embed_tokens.weight", make(vocab_rows, d))
    for i in range(layers):
        pre = f"model.layers.{i}"
        put_param(root, f"{pre}.self_attn.qkv_proj.weight", make(q + 2 * kv, d))
        put_param(root, f"{pre}.self_attn.o_proj.weight", make(d, q))
        put_param(root, f"{pre}.mlp.gate_up_proj.weight", make(2 * inter, d))
        put_param(root, f"{pre}.mlp.down_proj.weight", make(d, inter))
        put_param(root, f"{pre}.input_layernorm.weight", make(d))
        put_param(root, f"{pre}.post_attention_layernorm.weight", make(d))
    put_param(root, "model.norm.weight", make(d))
    if tied:
        put_param(root, "lm_head.weight", root.get_parameter("model.embed_tokens.weight"))
    else:
        put_param(root, "lm_head.weight", make(vocab_rows, d))
