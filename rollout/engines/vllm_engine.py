"""The ``vllm`` engine: vLLM 0.33.0 generating in this process, its weights patched in place.

Why in-process (``vllm.LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) rather than an
external ``vllm serve``: :class:`~deltarl.rollout.sync.weights.WeightSync` owns the weights through
:meth:`Engine.named_parameters` (live tensors it stages into, scatters into during a pause and
hashes to verify) and is the gate of every forward step. In-process, vLLM's scheduler step *is*
our forward step: :meth:`VllmEngine.generate` steps vLLM's engine core itself, entering the
gate around each step, exactly like the transformers engine's decode loop, so the pause is the
same ``apply_staged`` between two steps (vLLM's ``/pause?mode=keep`` equivalent: requests keep
their KV cache), the stamps say which weights sampled which token, and the shared delta code
(stage, apply, verify, host mirror, anchors) runs unchanged on vLLM's own GPU tensors. An
external server would put a process boundary between the weights and ``WeightSync``: every
apply would become an RPC and the per-step gate an HTTP pause/resume round trip.

How the tensors are reached: vLLM's worker builds our weight-transfer backend (``backend
"deltarl"``, :mod:`.vllm_backend`) with its model; ``init_weight_transfer_engine`` hands it the
Hugging Face tensor list (from the model's config, on the meta device), and the backend maps each
name onto a contiguous view of vLLM's fused parameters (:mod:`.vllm_mapping`); the worker
extension's ``deltarl_views`` RPC returns those live views (in-process: the objects themselves).
The same backend also takes deltas through vLLM's own ``update_weights`` route
(:mod:`.vllm_transfer`), for a vLLM that runs in another process.

Sampling (one vLLM request per prompt): ``temperature``, ``top_p``, ``top_k`` (0: off), stop
tokens as given and nothing else (``ignore_eos``; ``generation_config="vllm"`` so the model's
generation config adds no defaults), ``logprobs=0`` with ``logprobs_mode="processed_logprobs"``:
the logprob of the sampled token under the distribution sampled from (after temperature and
top-k/top-p, renormalized), as the transformers engine returns. Greedy (temperature 0) reports
0.0 (a point mass), like the transformers engine, not vLLM's log-softmax of the raw logits. A
call's ``seed`` gives request ``i`` the seed ``seed + i`` (reproducible on the same GPU, not the
transformers engine's tokens). Logprobs come back flat (``flat_logprobs``: plain lists instead
of a ``{token: Logprob}`` dict per token, which vLLM's output processing and the garbage
collector pay for at every step).

Prefix caching (``VllmEngineSettings.prefix_caching``, on by default) is salted per weight
state: every request carries ``cache_salt`` = :func:`cache_salt` of the stamp held when it was
admitted, and vLLM puts the salt into the hash of a request's first KV block, which every later
block's hash chains from (``v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``).
A request admitted under one weight state therefore never reuses a block computed for a request
admitted under an older one; requests of the same state (the turns of a multi-turn episode, the
prompts of a group sharing a system prompt) do. Requests are admitted inside the gate of the
call's first step, whose stamp is the completion's ``first``: a sync cannot land between reading
the salt and admitting the request. (Resetting vLLM's prefix cache at each apply instead cannot
work during generation: ``reset_prefix_cache`` refuses while running requests hold blocks, and
those blocks stay hashed.)

Async scheduling (vLLM's default, ``async_scheduling=True``): each ``step()`` launches the next
batch on the GPU before it returns the outputs of the one launched before it, so the CPU's
scheduling and output processing overlap the GPU's forward. Two things keep the guarantees:
the stamp of a batch is the gate's stamp *when it was launched* (:class:`_Launches` follows
vLLM's batch queue, so tokens returned one step later carry the weights that sampled them), and
the weight sync waits for the device inside its pause before it writes (a launched forward
finishes on the weights it was launched with; :meth:`WeightSync._exclusive`). With
``async_scheduling=False`` one ``step()`` is one forward whose tokens it returns.

Tensor parallelism > 1 (``tensor_parallel_size``): the engine core still runs here, each rank in
a vLLM worker process; the weights are shards there, reached through
:class:`~deltarl.rollout.engines.vllm_shards.ShardedWeights` (:meth:`sharded_weights`) instead
of views, and every rank's shard is patched in one ``collective_rpc`` inside the pause.

Scoring (:meth:`VllmEngine.score_batch`, hinted self-distillation): vLLM's ``prompt_logprobs``
at temperature 1.0, through the same gated step loop.

Every completion's ``first`` stamp is that of the call's first step (its prompt may have been
prefilled then, in chunks, or reused from blocks of the same weight state), ``last`` that of the
batch that sampled its last token.

Generation reads the engine core's outputs itself (:class:`_CoreRequests`): requests go
through vLLM's input processor straight to the in-process engine core, and each step's
``EngineCoreOutput`` (the step's new token ids and their logprobs, per request) is appended to
the completions here, without vLLM's front-end ``OutputProcessor`` (a request state, logprob
container and stop-string detokenizer per request, updated at every step). In this process the
front end's work is on the critical path of every step (vLLM's default runs the engine core in
a process of its own, the front end beside it): ~1.1 ms per step at batch 256 on a 2-core CPU
against ~0.12 ms for reading the outputs here, of 6-8 ms per step of a 0.6B model on an H200.
Stop tokens are the engine core's (``stop_token_ids``); the engine sets no stop strings, the
one thing the front end would add. Scoring (prompt logprobs) keeps vLLM's ``LLMEngine.step``.

Per step, the loop adds the gate (enter, exit) and the batch-queue bookkeeping of
:class:`_Launches`: about 15 us per step on a 2-core CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
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
    VllmEngineSettings,
    WeightsGate,
    WeightsStamp,
    check_prompts,
    check_score_items,
)
from deltarl.rollout.engines.vllm_mapping import TensorSpec, fp8_specs, specs_of
from deltarl.rollout.engines.vllm_shards import Box, ShardedWeights, connect, new_key
from deltarl.rollout.engines.vllm_transfer import (
    BACKEND_NAME,
    WORKER_EXTENSION,
    register,
    set_fp8_environment,
)
from deltarl.teacher.engines.vllm_engine import ranked_entries, shutdown_llm

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
MAX_SCORE_K = 128  # the largest top-k score() returns (vLLM's max_logprobs; hint_top_k's cap)
INPROC_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def import_vllm() -> Any:
    """``import vllm``, or a ``ModuleNotFoundError`` that says what to install."""
    try:
        import vllm
    except ModuleNotFoundError as err:
        if err.name != "vllm":
            raise
        raise ModuleNotFoundError(
            f"the vllm engine needs vLLM {VLLM_VERSION} and a CUDA GPU: pip install "
            "'deltarl[vllm]' (it pins torch 2.14.0), or use engine 'transformers'",
            name="vllm",
        ) from err
    if vllm.__version__ != VLLM_VERSION:
        raise ModuleNotFoundError(
            f"the vllm engine is written against vLLM {VLLM_VERSION}, found {vllm.__version__}: "
            "pip install 'deltarl[vllm]'",
            name="vllm",
        )
    return vllm


def hf_specs(model: str, dtype: str, fp8_block: int | None = None) -> list[TensorSpec]:
    """The trainer's tensors: the Hugging Face model's parameters (tied ones once), built on
    the meta device from ``model``'s config (no weights read); in block fp8 (a trainer with
    ``publish.fp8``) when the config's ``quantization_config`` is, or with ``fp8_block`` (the
    engine's setting, which :func:`llm_kwargs` turns into that config for vLLM)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from deltarl.weightsync.fp8 import block_of, config_block
    from deltarl.weightsync.model_state import publishable_state

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    specs = specs_of(publishable_state(hf))  # float buffers too (DeepSeek-V3's router bias)
    block = config_block(getattr(config, "quantization_config", None))
    if fp8_block is not None:
        if block not in (None, block_of(fp8_block)):
            raise ValueError(
                f"{model}: a block-fp8 checkpoint in {block[0]} x {block[1]} blocks, and the "
                f"engine's fp8_block asks for {fp8_block} x {fp8_block}"
            )
        block = block_of(fp8_block)
    return fp8_specs(specs, block) if block is not None else specs


def fp8_overrides(settings: VllmEngineSettings, specs: list[TensorSpec]) -> dict[str, Any]:
    """vLLM's ``hf_overrides`` that make it serve ``settings.model`` in block fp8 of
    ``settings.fp8_block`` (``specs``: :func:`hf_specs` of the same settings): the
    ``quantization_config`` a block-fp8 checkpoint of the model would carry, the tensors kept in
    higher precision listed in ``modules_to_not_convert``. Its weights are dummies until the
    bucket's fp8 anchor arrives."""
    from deltarl.weightsync.fp8 import block_of, kept_modules, quantization_config

    if settings.fp8_block is None:
        return {}
    shapes = {s.name: s.shape for s in specs}
    config = quantization_config(block=block_of(settings.fp8_block))
    config["modules_to_not_convert"] = kept_modules(shapes, shapes)
    return {"quantization_config": config}


def llm_kwargs(
    settings: VllmEngineSettings, specs: list[TensorSpec] | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for the engine (also used by bench/vllm_speed.py to
    time plain vLLM with the same settings); ``specs``: :func:`hf_specs` of the settings when
    the caller has them (an fp8 engine needs them)."""
    from vllm.config.weight_transfer import WeightTransferConfig

    if settings.fp8_block is not None and specs is None:
        specs = hf_specs(settings.model, settings.dtype, settings.fp8_block)
    return {
        "model": settings.model,
        "dtype": settings.dtype,
        "seed": settings.seed,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "enable_expert_parallel": settings.expert_parallel,
        "enable_return_routed_experts": settings.return_routed_experts,
        "model_impl": settings.model_impl,
        "load_format": settings.load_format,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "max_logprobs": MAX_SCORE_K,  # score()'s top-k (prompt logprobs)
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": settings.prefix_caching,  # salted per weight state
        "async_scheduling": settings.async_scheduling,
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",
        "skip_tokenizer_init": True,  # token ids in and out; the worker has its tokenizer
        "weight_transfer_config": WeightTransferConfig(backend=BACKEND_NAME),
        "worker_extension_cls": WORKER_EXTENSION,
        "hf_overrides": fp8_overrides(settings, specs or []),
    }


def request_params(
    params: SamplingParams, index: int, routing_from: Sequence[int] | None = None
) -> dict[str, Any]:
    """Keyword arguments of vLLM's ``SamplingParams`` for prompt ``index`` of a call (the same
    for every index unless the call has a seed or records routing)."""
    extra = (
        {} if routing_from is None else {"routed_experts_prompt_start": int(routing_from[index])}
    )
    return extra | {
        "n": 1,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": True,
        "logprobs": 0,
        "seed": None if params.seed is None else params.seed + index,
        "detokenize": False,
        "skip_special_tokens": False,
        "flat_logprobs": True,  # lists, not a dict + Logprob object per token (GC, per step)
    }


def cache_salt(stamp: WeightsStamp) -> str:
    """The prefix-cache salt of requests admitted under ``stamp``: one per weight state
    (``seq`` tells a failed apply of a version from its later reload, so both are in it)."""
    return f"deltarl-v{stamp.version}-s{stamp.seq}"


class VllmEngine(Engine):
    """An in-process vLLM ``LLM`` behind :class:`Engine` (see the module docstring).

    Build it with :meth:`from_settings`. The constructor takes the pieces (``llm``: a
    ``vllm.LLM``; ``views``: the backend's Hugging Face-named views; ``make_params``: vLLM's
    ``SamplingParams`` with ``output_kind`` FINAL_ONLY) so that the step loop is testable without
    vLLM.
    """

    type = "vllm"

    def __init__(
        self,
        llm: Any,
        views: Mapping[str, torch.Tensor],
        *,
        vocab_size: int,
        make_params: Callable[..., Any],
        shards: ShardedWeights | None = None,
        routes: bool = False,
    ) -> None:
        self._shards = shards
        self._routes = routes  # vLLM started with enable_return_routed_experts
        if shards is not None:
            if views:
                raise ValueError("a sharded engine has no views of its own")
            devices = {torch.device("cuda", 0)}  # rank 0's; the weights are in vLLM's workers
        else:
            if not views:
                raise ValueError("no weights mapped onto the vLLM model")
            devices = {t.device for t in views.values()}
            if len(devices) != 1:
                raise ValueError(f"weights on several devices: {sorted(map(str, devices))}")
        self._llm = llm
        self._views = dict(views)
        self._device = devices.pop()
        self._vocab = vocab_size
        self._make_params = make_params
        self._busy = threading.Lock()
        # per prompt of the last generate call: prompt tokens vLLM found in its prefix cache
        self.last_cached_tokens: list[int | None] = []
        # the cache_salt of request i of a call admitted under a stamp: one per weight state
        # (bench/vllm_speed.py swaps in one salt per request to measure without reuse)
        self._salt_of: Callable[[WeightsStamp, int], str] = lambda stamp, i: cache_salt(stamp)
        # async scheduling: vLLM's in-process engine core keeps a batch queue
        core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
        queue = getattr(core, "batch_queue", None)
        self._launches = _Launches(queue) if queue is not None else None

    @classmethod
    def from_settings(cls, settings: VllmEngineSettings) -> VllmEngine:
        """Start vLLM in this process with the deltarl backend and map the weights."""
        if os.environ.setdefault(INPROC_ENV, "0") != "0":
            raise ValueError(
                f"the vllm engine runs vLLM in this process: unset {INPROC_ENV} or set it to 0"
            )
        vllm = import_vllm()
        from vllm.sampling_params import RequestOutputKind

        register()  # in case the entry point is not installed (e.g. a source checkout)
        specs = hf_specs(settings.model, settings.dtype, settings.fp8_block)
        if settings.fp8_block is not None:
            set_fp8_environment()  # inherited by vLLM's engine and worker processes
        llm = vllm.LLM(**llm_kwargs(settings, specs))
        try:  # map the checkpoint tensors onto vLLM's parameters (MappingError if impossible)
            llm.init_weight_transfer_engine(
                {"init_info": {"tensors": [s.to_json() for s in specs]}}
            )
            vocab = int(llm.llm_engine.model_config.get_vocab_size())
            shards = None
            if settings.tensor_parallel_size == 1:
                (views,) = llm.collective_rpc("deltarl_views")
            else:
                views, shards = {}, _connect_shards(llm, specs)
        except BaseException:
            shutdown_llm(llm)  # release the GPU memory vLLM took
            raise
        logger.info(
            "vllm engine: %s (%s, model_impl=%s, load_format=%s, tp=%d), %d tensors mapped",
            settings.model,
            settings.dtype,
            settings.model_impl,
            settings.load_format,
            settings.tensor_parallel_size,
            len(specs),
        )

        def make_params(**kwargs: Any) -> Any:
            # FINAL_ONLY: one output per request, in the step that finished it (whose batch's
            # stamp is the request's last); DELTA would build an output per request per step
            return vllm.SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **kwargs)

        return cls(
            llm,
            views,
            vocab_size=vocab,
            make_params=make_params,
            shards=shards,
            routes=settings.return_routed_experts,
        )

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def llm(self) -> Any:
        """The ``vllm.LLM`` (for vLLM's own calls: ``collective_rpc``, the weight-update
        lifecycle); generating through it directly bypasses the weights gate."""
        return self._llm

    def named_parameters(self) -> Mapping[str, torch.Tensor]:
        if self._shards is not None:
            raise RuntimeError(
                "the weights of a tensor-parallel vllm engine are shards in vLLM's worker "
                "processes: use sharded_weights()"
            )
        return self._views

    def sharded_weights(self) -> ShardedWeights | None:
        return self._shards

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        gate: WeightsGate | None = None,
        routing_from: Sequence[int] | None = None,
    ) -> list[Completion]:
        check_prompts(prompts, self._vocab)
        if routing_from is not None:
            if not self._routes:
                raise NotImplementedError(
                    "routing replay needs vLLM started with return_routed_experts"
                )
            if len(routing_from) != len(prompts):
                raise ValueError(
                    f"routing_from has {len(routing_from)} starts for {len(prompts)} prompts"
                )
        greedy = params.temperature == 0.0
        routed: list[np.ndarray | None] = [None] * len(prompts)
        chunks: list[list[np.ndarray]] = [[] for _ in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        reasons: list[FinishReason] = ["length"] * len(prompts)
        last: list[WeightsStamp] = [UNMANAGED] * len(prompts)
        cached: list[int | None] = [None] * len(prompts)

        def take(i: int, out: Any, sampled: WeightsStamp) -> bool:
            """One ``EngineCoreOutput`` of request ``i``: the step's new tokens (one per step
            without speculative decoding) and their processed logprobs; True once finished."""
            new = out.new_token_ids
            if new:
                tokens[i].extend(new)
                logprobs[i].extend([0.0] * len(new) if greedy else _sampled_logprobs(out, new))
                last[i] = sampled
            if out.routed_experts is not None:
                chunks[i].append(out.routed_experts)
            if cached[i] is None and out.prefill_stats is not None:
                cached[i] = out.prefill_stats.num_cached_tokens
            if out.finish_reason is None:
                return False
            reasons[i] = _finish_reason(out, i)
            if routing_from is not None and chunks[i]:
                routed[i] = np.concatenate(chunks[i], axis=0).astype(np.uint16)
            return True

        if params.seed is None and routing_from is None:
            # one vLLM SamplingParams for all (vLLM clones it per request)
            shared = self._make_params(**request_params(params, 0))
            requests = [(list(p), shared) for p in prompts]
        else:  # request i samples with seed + i, its routing from routing_from[i]
            requests = [
                (list(p), self._make_params(**request_params(params, i, routing_from)))
                for i, p in enumerate(prompts)
            ]
        first = self._run(requests, gate, take, _CoreRequests(self._llm.llm_engine))[0]
        self.last_cached_tokens = cached
        return [
            Completion(tokens[i], logprobs[i], reasons[i], first, last[i], routed[i])
            for i in range(len(prompts))
        ]

    def _run(
        self,
        requests: Sequence[tuple[list[int], Any]],
        gate: WeightsGate | None,
        take: Callable[[int, Any, WeightsStamp], bool],
        route: _CoreRequests | _EngineRequests,
    ) -> list[WeightsStamp]:
        """Add ``requests`` (prompt, vLLM ``SamplingParams``) through ``route`` and step vLLM,
        each step inside ``gate``, until all finished; ``take(index, output, stamp)`` gets every
        output with the stamp of the batch that produced it and says whether the request
        finished. Returns the stamps held at each step (the first: the one the requests were
        admitted under, whose :func:`cache_salt` they carry). A gate error aborts the requests
        left before it propagates."""
        if not requests:
            return []
        call = uuid.uuid4().hex[:12]
        row: dict[str, int] = {}  # vLLM's id of each request -> its index
        stamps: list[WeightsStamp] = []
        pending: set[str] = set()  # requests vLLM holds for this call
        with self._busy:
            try:
                while not stamps or pending:
                    ctx = gate.forward() if gate is not None else contextlib.nullcontext(UNMANAGED)
                    with ctx as stamp:
                        if not stamps:  # admitted inside the first step's gate: no apply between
                            for n, (prompt, sp) in enumerate(requests):
                                inputs = {
                                    "prompt_token_ids": prompt,
                                    "cache_salt": self._salt_of(stamp, n),
                                }
                                rid = route.add(f"deltarl-{call}-{n}", inputs, sp)
                                row[rid] = n
                                pending.add(rid)
                        outputs = route.step()
                    # sync scheduling: the step's own forward; async: the batch launched before
                    sampled = stamp if self._launches is None else self._launches.after(stamp)
                    stamps.append(stamp)
                    for out in outputs:
                        i = row.get(out.request_id)
                        if i is not None and take(i, out, sampled):
                            pending.discard(out.request_id)
            finally:
                if pending:
                    route.abort(sorted(pending))
        return stamps

    def score_batch(
        self,
        items: Sequence[tuple[Sequence[int], int]],
        k: int,
        temperature: float = 1.0,
        *,
        gate: WeightsGate | None = None,
    ) -> list[ScoredTokens]:
        """vLLM's ``prompt_logprobs`` (``max_tokens=1``): every sequence prefilled once, the
        logprob of each token from ``start`` on and the ``k`` most likely ids there.

        Temperature 1.0 only: vLLM's prompt logprobs are the raw log-softmax whatever the
        request's temperature (``gpu_model_runner.py`` ``_get_prompt_logprobs_dict``), and the
        top-k alone cannot be re-tempered (that needs the whole vocabulary). The scoring runs
        in the step loop (it waits for a running :meth:`generate` call), every step inside
        the gate; if a weight sync lands between the steps of one scoring (a long prompt
        prefilled in chunks), the scores would mix two weight versions: it is scored again
        (at most 3 times), so every :class:`ScoredTokens` has one stamp."""
        if not items:
            return []
        check_score_items(items, self._vocab, k, MAX_SCORE_K)
        if temperature != 1.0:
            raise ValueError(
                "the vllm engine scores at temperature 1.0 only (vLLM's prompt logprobs are "
                f"the raw distribution), got {temperature}: use the transformers engine"
            )
        for _ in range(3):
            rows, seen = self._score_once(items, k, gate)
            if len(seen) == 1:
                break
            logger.info("a weight sync landed while scoring (stamps %s): scoring again", seen)
        else:
            raise RuntimeError("weights changed during every one of 3 scoring attempts")
        (stamp,) = seen
        out = []
        for (tokens, start), entries in zip(items, rows, strict=True):
            if entries is None or len(entries) != len(tokens):
                raise RuntimeError("vLLM returned no prompt logprobs for a scored sequence")
            sampled, ids, lps = [], [], []
            for p in range(start, len(tokens)):
                lp, ranked = ranked_entries(entries[p], int(tokens[p]), k, p)
                if len(ranked) != k:
                    raise RuntimeError(f"vLLM returned {len(ranked)} of {k} logprobs at {p}")
                sampled.append(lp)
                ids.append([t for t, _ in ranked])
                lps.append([x for _, x in ranked])
            out.append(ScoredTokens(sampled=sampled, ids=ids, logprobs=lps, stamp=stamp))
        return out

    def _score_once(
        self, items: Sequence[tuple[Sequence[int], int]], k: int, gate: WeightsGate | None
    ) -> tuple[list[Any], set[WeightsStamp]]:
        """Each item's ``prompt_logprobs`` and every stamp its scoring ran under."""
        rows: list[Any] = [None] * len(items)
        seen: set[WeightsStamp] = set()

        def take(i: int, out: Any, sampled: WeightsStamp) -> bool:
            if out.finished:
                rows[i] = out.prompt_logprobs
                seen.add(sampled)
            return bool(out.finished)

        params = self._make_params(
            n=1, max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False
        )
        requests = [(list(t), params) for t, _ in items]
        seen.update(self._run(requests, gate, take, _EngineRequests(self._llm.llm_engine)))
        return rows, seen

    def close(self) -> None:
        """Shut vLLM's engine core down (frees the GPU memory it holds)."""
        if self._shards is not None:
            self._shards.close()
        shutdown_llm(self._llm)


class _CoreRequests:
    """Requests straight into vLLM's in-process engine core (see the module docstring): vLLM's
    input processor makes each request (validation, a copy of its parameters, the id vLLM
    makes unique), the engine core schedules it, and each step returns the engine core's
    outputs, read by the caller, with no front-end request state to keep or free."""

    def __init__(self, engine: Any) -> None:
        self._inputs = engine.input_processor
        self._core = engine.engine_core
        self._tasks = engine.get_supported_tasks()

    def add(self, rid: str, inputs: dict[str, Any], params: Any) -> str:
        request = self._inputs.process_inputs(rid, inputs, params, supported_tasks=self._tasks)
        self._inputs.assign_request_id(request)
        self._core.add_request(request)
        return str(request.request_id)

    def step(self) -> list[Any]:
        return list(self._core.get_output().outputs)

    def abort(self, ids: list[str]) -> None:
        self._core.abort_requests(ids)


class _EngineRequests:
    """Requests through vLLM's ``LLMEngine`` (its output processor assembles each request's
    ``RequestOutput``): scoring, whose prompt logprobs vLLM's front end formats."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def add(self, rid: str, inputs: dict[str, Any], params: Any) -> str:
        self._engine.add_request(rid, inputs, params)
        return rid

    def step(self) -> list[Any]:
        return list(self._engine.step())

    def abort(self, ids: list[str]) -> None:
        self._engine.abort_request(ids)


def _sampled_logprobs(out: Any, new: list[int]) -> list[float]:
    """The processed logprobs of an ``EngineCoreOutput``'s new tokens (``logprobs=0``: one
    column, the sampled token's), checked to be those of the tokens it sampled."""
    got = out.new_logprobs
    if got is None or len(got.logprobs) != len(new):
        n = 0 if got is None else len(got.logprobs)
        raise RuntimeError(f"vLLM returned {n} logprobs for {len(new)} tokens")
    if len(new) == 1:  # the usual step: no array slices
        if int(got.logprob_token_ids[0, 0]) != new[0]:
            raise RuntimeError("vLLM's logprobs are not those of the sampled tokens")
        return [float(got.logprobs[0, 0])]
    if got.logprob_token_ids[:, 0].tolist() != new:
        raise RuntimeError("vLLM's logprobs are not those of the sampled tokens")
    return [float(x) for x in got.logprobs[:, 0].tolist()]


def _finish_reason(out: Any, index: int) -> FinishReason:
    """A finished ``EngineCoreOutput``'s reason (vLLM's ``FinishReason``: STOP for a stop
    token, LENGTH for ``max_tokens`` or the model's length); any other ends the call."""
    name = getattr(out.finish_reason, "name", str(out.finish_reason))
    if name == "STOP":
        return "stop"
    if name == "LENGTH":
        return "length"
    detail = f": {out.error}" if getattr(out, "error", None) is not None else ""
    raise RuntimeError(f"vLLM ended prompt {index} of the call with {name}{detail}")


class _Launches:
    """The weights each batch in vLLM's batch queue was launched with (async scheduling).

    vLLM's ``EngineCore.step_with_batch_queue`` appends at most one launched batch (an entry
    ``(future, scheduler_output, exec_future)``) and pops at most one finished batch per
    ``step()``, returning the popped batch's outputs. :meth:`after` is called after every
    ``step()`` with the stamp held during it: new entries get that stamp; the entry that left
    the queue is the batch whose outputs the step returned, and its stamp is returned (a batch
    launched and popped within the same step has the step's own stamp). Entries are matched by
    identity of their scheduler output, and the record outlives a ``generate`` call: a batch
    still in flight when one call ends is popped by the next.
    """

    def __init__(self, queue: Any) -> None:
        self._queue = queue
        self._stamps: list[tuple[Any, WeightsStamp]] = []

    def after(self, stamp: WeightsStamp) -> WeightsStamp:
        live = [entry[1] for entry in self._queue]
        for batch in live:
            if not any(batch is known for known, _ in self._stamps):
                self._stamps.append((batch, stamp))
        sampled, kept = stamp, []
        for batch, launched in self._stamps:
            if any(batch is other for other in live):
                kept.append((batch, launched))
            else:
                sampled = launched
        self._stamps = kept
        return sampled


def _connect_shards(llm: Any, specs: Sequence[TensorSpec]) -> ShardedWeights:
    """Start every rank's staging thread (``deltarl_tp_serve``) and connect to it."""
    key = new_key()
    where = os.path.join(tempfile.mkdtemp(prefix="deltarl-tp-"), "rank")
    infos = llm.collective_rpc("deltarl_tp_serve", args=(where, key.hex()))
    boxes = [{n: Box.from_json(b) for n, b in info["boxes"].items()} for info in infos]
    conns = connect([str(info["address"]) for info in infos], key)

    def rpc(method: str, *args: Any) -> list[Any]:
        return list(llm.collective_rpc(method, args=args))

    return ShardedWeights({s.name: (s.dtype, s.shape) for s in specs}, boxes, conns, rpc)
