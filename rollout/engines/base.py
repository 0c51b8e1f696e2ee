"""The engine interface of a rollout worker: one ABC and its wire-free records.

An engine turns a batch of token-id prompts into sampled token ids plus the logprob of each
sampled token, and exposes its weights as named tensors that the weight sync overwrites in
place. Engines are picked by configuration (``EngineSettings``, discriminated on ``type``) and
built by :func:`~deltarl.rollout.engines.factory.make_engine` (factory.py); importing this module pulls in neither torch nor transformers.

Weights gate: :meth:`Engine.generate` takes an optional :class:`WeightsGate` (the rollout
worker's :class:`~deltarl.rollout.sync.weights.WeightSync`). The engine enters ``gate.forward()``
around every forward step (prefill and each decode step) and records the
:class:`WeightsStamp` it yields, so a weight update can land *between* two steps of a
generation (the only pause generation sees is the in-place apply) and every completion says
which weights sampled its first and its last token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import numpy as np
    import torch

EngineType = Literal["transformers", "vllm"]
FinishReason = Literal["stop", "length"]


class SamplingParams(BaseModel):
    """How to sample one batch. Example: ``SamplingParams(max_new_tokens=64, temperature=1.0)``.

    Logprobs are those of the distribution actually sampled from: the logits divided by
    ``temperature``, then restricted to the ``top_k`` most likely tokens and to the nucleus of
    mass ``top_p``, renormalized. See docs/rollout.md for what that means for the importance
    ratio (in short: keep ``top_p=1`` and ``top_k=0`` for training rollouts, and have the
    trainer divide its logits by the same temperature).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(default=128, ge=1, description="Most tokens sampled per prompt.")
    temperature: float = Field(
        default=1.0,
        ge=0.0,
        description="Logits are divided by it; 0 means greedy (argmax, logprob 0.0: the sampled "
        "distribution is a point mass).",
    )
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Nucleus mass kept (1.0: no truncation)."
    )
    top_k: int = Field(default=0, ge=0, description="Most likely tokens kept (0: all).")
    stop_token_ids: tuple[int, ...] = Field(
        default=(),
        description="Sampling a token of this set ends that completion (the token is kept and "
        "its logprob returned). The engine adds none by itself, not even EOS.",
    )
    seed: int | None = Field(
        default=None,
        description="Seed of this call's sampler: the same seed, prompts and weights give the "
        "same tokens on the same device. None: continue the engine's own seeded generator.",
    )


@dataclass(frozen=True, slots=True)
class WeightsStamp:
    """Which weights ran a forward step.

    ``version``: the trainer's policy version (None: weights not managed by a weight sync).
    ``seq``: counts weight states installed in this process (every applied delta or loaded
    anchor adds one); it tells a failed apply of version v apart from a later reload of v.
    """

    version: int | None
    seq: int


UNMANAGED = WeightsStamp(version=None, seq=0)
"""Stamp recorded by a generation that ran without a gate."""


class WeightsGate(Protocol):
    """What :meth:`Engine.generate` needs from a weight sync.

    ``forward()`` is entered around every forward step; it blocks while an update is being
    applied, raises (e.g. :class:`~deltarl.rollout.sync.weights.WeightsUnhealthyError`) when the
    weights must not be used, and yields the stamp of the weights the step runs with.
    """

    def forward(self) -> AbstractContextManager[WeightsStamp]: ...


@dataclass(frozen=True, slots=True)
class Completion:
    """What one prompt produced.

    Example::

        Completion(token_ids=[812, 13, 2], logprobs=[-0.41, -2.3, -0.02], finish_reason="stop",
                   first=WeightsStamp(7, 3), last=WeightsStamp(8, 4))
    """

    token_ids: list[int]  # sampled tokens, in order (a stop token that ended it included)
    logprobs: list[float]  # [len(token_ids)] logprob of each under the sampled distribution
    finish_reason: FinishReason  # "stop": a stop token was sampled; "length": max_new_tokens
    first: WeightsStamp  # weights that sampled the first token
    last: WeightsStamp  # weights that sampled the last token (differs if a sync happened)
    # MoE routing of the positions ``routing_from .. len(prompt) + len(token_ids) - 2`` as
    # [rows, moe layers, top_k] expert ids (generate(routing_from=...)); None: not recorded
    routed_experts: np.ndarray | None = None

    @property
    def version_min(self) -> int | None:
        """Oldest policy version that sampled a token (None: unmanaged weights)."""
        return self.first.version

    @property
    def version_max(self) -> int | None:
        """Newest policy version that sampled a token (None: unmanaged weights)."""
        return self.last.version


class Engine(ABC):
    """A generator whose weights can be overwritten in place.

    Thread safety: one :meth:`generate` call at a time per engine (callers serialize); the
    weight sync may write :meth:`named_parameters` from another thread only while holding the
    gate exclusively (i.e. between two forward steps).
    """

    type: ClassVar[EngineType]

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device holding the weights (and where deltas are staged)."""

    @abstractmethod
    def named_parameters(self) -> Mapping[str, torch.Tensor]:
        """The live weight tensors by name: contiguous, writable in place, each storage once.

        The names are the trainer's (Hugging Face parameter names, tied weights listed once);
        anchors and deltas must name exactly these tensors.
        """

    @abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        gate: WeightsGate | None = None,
        routing_from: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Sample one completion per prompt (token ids), in prompt order.

        ``gate`` is entered around every forward step (see the module docstring); without one,
        every stamp is :data:`UNMANAGED`. ``routing_from`` (one start per prompt): record which
        experts a mixture-of-experts model routed each position to, from that position on,
        into :attr:`Completion.routed_experts` (:mod:`deltarl.services.common.moe_routing`);
        an engine that cannot raises ``NotImplementedError``. Raises ``ValueError`` for an
        empty prompt or a token id outside the vocabulary, and whatever the gate raises.
        """

    def score(
        self,
        tokens: Sequence[int],
        start: int,
        k: int,
        temperature: float = 1.0,
        *,
        gate: WeightsGate | None = None,
    ) -> ScoredTokens:
        """One forward pass over ``tokens`` (no decoding): for each position ``p >= start``,
        the logprob of ``tokens[p]`` given ``tokens[:p]`` and the ``k`` most likely ids there,
        under ``softmax(logits / temperature)`` (hinted self-distillation scores a turn this
        way). :meth:`score_batch` of one item."""
        return self.score_batch([(tokens, start)], k, temperature, gate=gate)[0]

    def score_batch(
        self,
        items: Sequence[tuple[Sequence[int], int]],
        k: int,
        temperature: float = 1.0,
        *,
        gate: WeightsGate | None = None,
    ) -> list[ScoredTokens]:
        """:meth:`score` of several ``(tokens, start)`` at once. Engines that cannot score raise
        :class:`NotImplementedError` (the default)."""
        raise NotImplementedError(f"the {self.type} engine cannot score token sequences")

    def sharded_weights(self) -> Any:
        """None (default): :meth:`named_parameters` are the weights. An engine whose weights
        live in other processes, in shards (the vllm engine at tensor parallelism > 1), returns
        its :class:`~deltarl.rollout.engines.vllm_shards.ShardedWeights`; the weight sync then
        stages, applies and verifies through it against its host mirror."""
        return None

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release the engine's resources (default: nothing to do)."""


@dataclass(frozen=True, slots=True)
class ScoredTokens:
    """What :meth:`Engine.score` returns for positions ``start .. n-1`` (``m`` of them)."""

    sampled: list[float]  # [m] logprob of the token at each position
    ids: list[list[int]]  # [m][k] the most likely ids, most likely first
    logprobs: list[list[float]]  # [m][k] their logprobs
    stamp: WeightsStamp  # the weights that scored them


def check_score_items(
    items: Sequence[tuple[Sequence[int], int]], vocab_size: int, k: int, max_k: int | None = None
) -> None:
    """``ValueError`` for what :meth:`Engine.score_batch` cannot score: a token outside the
    vocabulary, a ``start`` outside ``1..len - 1``, ``k`` outside ``1..max_k`` (default: the
    vocabulary)."""
    check_prompts([t for t, _ in items], vocab_size)
    for tokens, start in items:
        if not 1 <= start < len(tokens):
            raise ValueError(f"start must be within 1..{len(tokens) - 1}, got {start}")
    top = vocab_size if max_k is None else min(vocab_size, max_k)
    if not 1 <= k <= top:
        raise ValueError(f"need 1 <= k <= {top}, got {k}")


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """The ``ValueError`` every engine's :meth:`Engine.generate` raises for no prompt, an empty
    prompt or a token id outside ``0 .. vocab_size - 1``."""
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token id")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"prompt {i} has token id {lo if lo < 0 else hi} outside the vocabulary "
                f"0..{vocab_size - 1}"
            )


class TransformersEngineSettings(BaseModel):
    """The embedded default engine: a Hugging Face causal LM in this process, CPU or GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["transformers"] = "transformers"
    model: str = Field(
        description="Hugging Face model id or local directory (config, and weights for "
        "init='pretrained')."
    )
    gguf_file: str | None = Field(
        default=None,
        description="A GGUF file inside ``model`` to read the config (and, for init="
        "'pretrained', dequantized weights) from; None: the usual Hugging Face files.",
    )
    init: Literal["config", "pretrained"] = Field(
        default="config",
        description="'config': build the architecture with random weights, which the weight sync "
        "then replaces with the bucket's anchor (no second download); 'pretrained': load the "
        "checkpoint's weights too (for use without a bucket).",
    )
    device: str = Field(
        default="auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda:1', ..."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Weight dtype; must match the trainer's published state."
    )
    attn_implementation: str | None = Field(
        default="sdpa", description="transformers attention backend; None: the model's default."
    )
    seed: int = Field(default=0, description="Seed of the engine's own sampling generator.")


class VllmEngineSettings(BaseModel):
    """vLLM 0.33.0 serving the policy from this process: one GPU, or ``tensor_parallel_size``
    GPUs through vLLM's worker processes (see docs/vllm.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["vllm"] = "vllm"
    model: str = Field(description="Hugging Face model id or local directory (its config).")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Weight dtype; must match the trainer's published state."
    )
    model_impl: Literal["auto", "vllm", "transformers"] = Field(
        default="auto",
        description="vLLM's model implementation; both fuse projections, which the engine maps "
        "(docs/vllm.md).",
    )
    load_format: Literal["dummy", "auto"] = Field(
        default="dummy",
        description="'dummy': random weights, which the weight sync replaces with the bucket's "
        "anchor (no checkpoint download); 'auto': vLLM loads the checkpoint's weights.",
    )
    gpu_memory_utilization: float = Field(
        default=0.85, gt=0.0, le=1.0, description="Share of the GPU's memory vLLM may take."
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="Longest sequence (tokens); None: the model's own."
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Most sequences in one batch; None: vLLM's default."
    )
    enforce_eager: bool = Field(
        default=False, description="Disable CUDA graphs (slower; for debugging)."
    )
    async_scheduling: bool = Field(
        default=True,
        description="vLLM's async scheduling: the next batch is launched before the last "
        "one's outputs are processed (faster; stamps and pauses stay exact, docs/vllm.md). "
        "False: one step = one forward, with the CPU work between forwards.",
    )
    prefix_caching: bool = Field(
        default=True,
        description="vLLM's prefix caching, salted per weight state: a request reuses only KV "
        "blocks computed under the weights it was admitted with (each request's cache_salt "
        "names that state, docs/vllm.md). False: every prompt is prefilled in full.",
    )
    seed: int = Field(default=0, description="Seed of vLLM's sampler when a call gives none.")
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="GPUs of one engine (vLLM's tensor parallelism; > 1 runs vLLM's workers in "
        "processes and patches every rank's shard in the same pause, docs/vllm.md).",
    )
    expert_parallel: bool = Field(
        default=False,
        description="vLLM's expert parallelism for mixture-of-experts models (with "
        "tensor_parallel_size > 1): each GPU holds whole experts, a contiguous range of them, "
        "instead of every expert's tensor-parallel slice; the engine maps either (docs/vllm.md).",
    )
    fp8_block: Literal[64, 128] | None = Field(
        default=None,
        description="Serve the policy in block fp8 with square blocks of this side (vLLM's "
        "fp8 quantization: the model's config gets the matching quantization_config, vLLM "
        "runs with VLLM_USE_DEEP_GEMM=0 and without Marlin's fp8 kernel, docs/vllm.md); set by "
        "the worker from fp8 and fp8_block. None: as the model's config says (bf16, or a "
        "block-fp8 checkpoint's own blocks).",
    )
    return_routed_experts: bool = Field(
        default=False,
        description="Start vLLM with enable_return_routed_experts, so that generate() can "
        "return each token's experts (routing replay, docs/rollout.md); set by the worker when "
        "routing_replay is on.",
    )


EngineSettings = Annotated[
    TransformersEngineSettings | VllmEngineSettings, Field(discriminator="type")
]
