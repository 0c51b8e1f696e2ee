"""The embedded default engine: a Hugging Face causal LM in this process, on CPU or GPU.

Generation is our own decode loop over the model's forward (not ``model.generate``), because
the loop must (1) enter the weights gate around every forward step, so that a weight update can
land between two tokens with generation paused only for the in-place apply, and (2) return the
logprob of each sampled token under the distribution it was actually sampled from.

Batching: prompts are left-padded to the longest one (pad positions are masked and get position
id 0), one KV cache serves the batch, and rows that sampled a stop token keep being fed (their
outputs are discarded) until every row is done or ``max_new_tokens`` is reached.

Sampling (:func:`sample_tokens`), in this order: logits in float32 / ``temperature``, keep the
``top_k`` largest (ties at the k-th value are kept), keep the smallest set of most likely tokens
whose mass reaches ``top_p``, renormalize (``log_softmax``), draw one token with the call's
``torch.Generator``. The returned logprob is the processed one. Temperature 0 is greedy and
reports logprob 0.0. With the same seed, prompts, weights and device the tokens are the same.

A sync that happens mid-generation leaves the KV entries of earlier tokens as computed by the
old weights; the completion then spans two versions (``first``/``last`` stamps), like every
in-flight weight update (PipelineRL, vLLM's pause mode "keep").
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from deltarl.rollout.engines.base import (
    UNMANAGED,
    Completion,
    Engine,
    FinishReason,
    SamplingParams,
    ScoredTokens,
    TransformersEngineSettings,
    WeightsGate,
    WeightsStamp,
    check_prompts,
    check_score_items,
)
from deltarl.services.common.moe_routing import RoutingRecorder
from deltarl.weightsync.model_state import publishable_state

logger = logging.getLogger(__name__)

PAD_ID = 0  # what pad positions hold; they are masked, so any valid id works


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> ``cuda`` if available else ``cpu``; anything else as ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use 'cpu'")
    return dev


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; return (tokens [B] int64, logprobs [B] f32).

    The logprob is that of the processed distribution (temperature, top-k, top-p; see the
    module docstring). Greedy (temperature 0) returns the argmax with logprob 0.0.
    """
    z = logits.float()
    if params.temperature == 0.0:
        tokens = z.argmax(dim=-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=z.device)
    z = z / params.temperature
    vocab = z.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(z, params.top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # drop a token when the mass of the more likely ones already reaches top_p
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    logp = torch.log_softmax(z, dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class TransformersEngine(Engine):
    """A ``transformers`` causal LM (already on its device) behind the :class:`Engine` interface.

    Build it from settings with :meth:`from_settings` (or :func:`~.factory.make_engine`), or wrap a
    model directly: ``TransformersEngine(LlamaForCausalLM(cfg).to(torch.bfloat16))``.
    """

    type = "transformers"

    def __init__(self, model: torch.nn.Module, *, seed: int = 0) -> None:
        # what the trainer publishes: parameters and persistent float buffers (DeepSeek-V3's
        # router bias), tied weights once, each in the dtype transformers built it in (a
        # router it keeps in fp32 stays fp32 in a bf16 model)
        params: dict[str, torch.Tensor] = publishable_state(model)
        if not params:
            raise ValueError("the model has no parameters")
        devices = {p.device for p in params.values()}
        if len(devices) != 1:
            raise ValueError(
                f"all weights must live on one device, got {sorted(map(str, devices))}"
            )
        bad = [n for n, p in params.items() if not p.is_contiguous()]
        if bad:
            raise ValueError(f"weights must be contiguous to be patched in place: {bad[:3]}")
        model.eval()
        model.requires_grad_(False)
        self._model = model
        self._params = params
        self._device = devices.pop()
        embeddings = model.get_input_embeddings()  # type: ignore[operator]
        self._vocab = int(embeddings.weight.shape[0])
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._busy = threading.Lock()
        # transformers >= 5.24 renamed ``past_key_values`` to ``cache`` (argument and output)
        accepted = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in accepted else "past_key_values"
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}

    @classmethod
    def from_settings(cls, settings: TransformersEngineSettings) -> TransformersEngine:
        """Load the architecture (and, for ``init='pretrained'``, the weights) on the device."""
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM

        device = resolve_device(settings.device)
        dtype = getattr(torch, settings.dtype)
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_arg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
        kwargs: dict[str, Any] = {dtype_arg: dtype}
        if settings.attn_implementation is not None:
            kwargs["attn_implementation"] = settings.attn_implementation
        gguf: dict[str, Any] = (
            {} if settings.gguf_file is None else {"gguf_file": settings.gguf_file}
        )
        if settings.init == "pretrained":
            model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
                settings.model, **gguf, **kwargs
            )
            model.to(device)
        else:
            config = AutoConfig.from_pretrained(settings.model, **gguf)
            with device:
                model = AutoModelForCausalLM.from_config(config, **kwargs)
        logger.info(
            "transformers engine: %s (%s init) on %s, %s, %.1fM parameters",
            settings.model,
            settings.init,
            device,
            settings.dtype,
            sum(p.numel() for p in model.parameters()) / 1e6,
        )
        return cls(model, seed=settings.seed)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def model(self) -> torch.nn.Module:
        """The wrapped model (read-only use: its weights are owned by the weight sync)."""
        return self._model

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: valid prompt token ids are ``0 .. vocab_size - 1``."""
        return self._vocab

    def named_parameters(self) -> Mapping[str, torch.Tensor]:
        return self._params

    def _batch(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        check_prompts(prompts, self._vocab)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        return ids.to(self._device), mask.to(self._device)

    def score_batch(
        self,
        items: Sequence[tuple[Sequence[int], int]],
        k: int,
        temperature: float = 1.0,
        *,
        gate: WeightsGate | None = None,
    ) -> list[ScoredTokens]:
        """One right-padded forward pass over every sequence. It does not wait for a running
        :meth:`generate` (a pure forward shares nothing with it; only the weights gate is
        entered, so an apply is never read half-done): scoring next to a generation loop that
        keeps the engine busy would otherwise wait for whole batches, again and again."""
        if not items:
            return []
        check_score_items(items, self._vocab, k)
        if not temperature > 0:
            raise ValueError(f"need temperature > 0, got {temperature}")
        width = max(len(t) for t, _ in items)
        ids = torch.full((len(items), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for i, (tokens, _) in enumerate(items):
            ids[i, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
            mask[i, : len(tokens)] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        out: list[ScoredTokens] = []
        with torch.inference_mode():
            ctx = gate.forward() if gate is not None else contextlib.nullcontext(UNMANAGED)
            with ctx as stamp:
                logits = self._model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            for i, (tokens, start) in enumerate(items):
                # position p is predicted by the logits at p - 1
                lp = torch.log_softmax(
                    logits[i, start - 1 : len(tokens) - 1].float() / temperature, dim=-1
                )
                sampled = lp.gather(-1, ids[i, start : len(tokens), None]).squeeze(-1)
                top = torch.topk(lp, k, dim=-1)
                out.append(
                    ScoredTokens(
                        sampled=sampled.tolist(),
                        ids=top.indices.tolist(),
                        logprobs=top.values.tolist(),
                        stamp=stamp,
                    )
                )
        return out

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        gate: WeightsGate | None = None,
        routing_from: Sequence[int] | None = None,
    ) -> list[Completion]:
        ids, mask = self._batch(prompts)
        if routing_from is not None and len(routing_from) != len(prompts):
            raise ValueError(
                f"routing_from has {len(routing_from)} starts for {len(prompts)} prompts"
            )
        recorder = (
            RoutingRecorder(self._model) if routing_from is not None else contextlib.nullcontext()
        )
        if params.seed is None:
            generator = self._generator
        else:
            generator = torch.Generator(device=self._device).manual_seed(params.seed)
        stop = frozenset(params.stop_token_ids)
        n = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        reasons: list[FinishReason] = ["length"] * n
        first: WeightsStamp | None = None
        last: list[WeightsStamp] = [UNMANAGED] * n
        active = list(range(n))
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        step_ids, cache = ids, None
        with self._busy, torch.inference_mode(), recorder:
            for _ in range(params.max_new_tokens):
                ctx = gate.forward() if gate is not None else contextlib.nullcontext(UNMANAGED)
                with ctx as stamp:
                    out = self._model(
                        input_ids=step_ids,
                        attention_mask=mask,
                        position_ids=positions,
                        use_cache=True,
                        **{self._cache_arg: cache},
                        **self._keep_last,
                    )
                    new, lp = sample_tokens(out.logits[:, -1, :], params, generator)
                    new_list, lp_list = new.tolist(), lp.tolist()
                cache = getattr(out, self._cache_arg)
                first = stamp if first is None else first
                still = []
                for i in active:
                    tokens[i].append(new_list[i])
                    logprobs[i].append(lp_list[i])
                    last[i] = stamp
                    if new_list[i] in stop:
                        reasons[i] = "stop"
                    else:
                        still.append(i)
                active = still
                if not active:
                    break
                step_ids = new[:, None]
                mask = torch.cat([mask, mask.new_ones((n, 1))], dim=-1)
                positions = positions[:, -1:] + 1
        assert first is not None
        routed: list[np.ndarray | None] = [None] * n
        if isinstance(recorder, RoutingRecorder) and recorder.layers:
            assert routing_from is not None
            routed = _routing_rows(recorder.calls, prompts, tokens, ids.shape[1], routing_from)
        return [
            Completion(tokens[i], logprobs[i], reasons[i], first, last[i], routed[i])
            for i in range(n)
        ]


def _routing_rows(
    calls: list[torch.Tensor],
    prompts: Sequence[Sequence[int]],
    tokens: list[list[int]],
    width: int,
    starts: Sequence[int],
) -> list[np.ndarray | None]:
    """Each prompt's routing record from the recorder's calls (the first: the left-padded
    prefill [n * width, ...]; then one row per prompt per decode step): positions
    ``starts[i] .. len(prompt) + len(completion) - 2``."""
    n = len(prompts)
    prefill = calls[0].view(n, width, *calls[0].shape[1:])
    out: list[np.ndarray | None] = []
    for i, p in enumerate(prompts):
        rows = [prefill[i, width - len(p) :]]
        # decode step j fed completion token j - 1: the row of position len(p) + j - 1
        rows += [calls[j][i : i + 1] for j in range(1, len(tokens[i]))]
        out.append(torch.cat(rows).numpy().astype(np.uint16)[starts[i] :])
    return out
