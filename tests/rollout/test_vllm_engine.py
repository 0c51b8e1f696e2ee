"""The vllm engine (docs/vllm.md) without vLLM, plus tests against vLLM's real classes.

vLLM cannot be installed here (CUDA build, torch 2.14), so:

* CPU tests build a model laid out like vLLM's Llama at TP=1 (fused ``qkv_proj`` and
  ``gate_up_proj``, vocabulary padded to 64 rows, a loader that narrows row blocks and copies)
  and drive our side: the name mapping, the wire message, the apply through the shared delta
  code, ``WeightSync`` following a bucket through the engine's views, the step loop, refusals;
* vLLM's source is checked with ``ast`` from the wheel when it lies at ``VLLM_WHEEL`` (nothing is
  downloaded): our backend implements every abstract method of its ``WeightTransferEngine``;
* tests that import vLLM are skipped unless it is installed (``importorskip``; the GPU one is
  marked ``gpu`` too).
"""

from __future__ import annotations

import ast
import contextlib
import enum
import functools
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from rollout_helpers import (
    FakeTrainer,
    clone_state,
    fused_llama_params,
    perturb,
    same_bits,
    tiny_config,
    tiny_engine,
)

from deltarl.rollout.engines import SamplingParams, VllmEngineSettings, WeightsStamp, make_engine
from deltarl.rollout.engines.vllm_engine import (
    VllmEngine,
    _finish_reason,
    _sampled_logprobs,
    cache_salt,
    hf_specs,
    llm_kwargs,
    request_params,
)
from deltarl.rollout.engines.vllm_mapping import (
    MappingError,
    TensorSpec,
    check_disjoint,
    probe_views,
    specs_of,
)
from deltarl.rollout.engines.vllm_transfer import (
    DeltaReceiver,
    check_supported,
    decode_message,
    encode_message,
)
from deltarl.rollout.settings import WorkerExperiment
from deltarl.rollout.sync.weights import WeightSync
from deltarl.weightsync import fp8
from deltarl.weightsync.delta import compute_delta
from deltarl.weightsync.digest import state_digest
from deltarl.weightsync.errors import (
    BaseMismatchError,
    CorruptDeltaError,
    VerificationError,
)
from deltarl.weightsync.reader import BucketReader

REPO = Path(__file__).resolve().parents[2]
VLLM_WHEEL = Path(
    os.environ.get(
        "DELTARL_VLLM_WHEEL", "/tmp/vllm-wheel/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    )
)

# ------------------------------------------------------------------ a vLLM-shaped model


STACKED: dict[
    str, tuple[str, str | int]
] = {  # checkpoint piece -> (fused runtime name, shard), as vLLM's Llama declares
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class FusedLlama(torch.nn.Module):
    """vLLM Llama's runtime layout at TP=1 with random weights (``load_format="dummy"``).

    ``tp=2`` plays rank 0 of two (the loader keeps half of each column-parallel tensor);
    ``scale_norms`` stores norms as ``w * 1`` (a transforming loader).
    """

    def __init__(
        self,
        cfg: Any,
        dtype: torch.dtype = torch.bfloat16,
        *,
        tp: int = 1,
        scale_norms: bool = False,
        seed: int = 123,
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        d, inter = cfg.hidden_size, cfg.intermediate_size
        hd = d // cfg.num_attention_heads
        self.q, self.kv = cfg.num_attention_heads * hd // tp, cfg.num_key_value_heads * hd // tp
        self.inter = inter // tp
        self.tp, self.scale_norms, self.tied = tp, scale_norms, cfg.tie_word_embeddings
        vocab = -(-cfg.vocab_size // 64) * 64 + 64  # padded, with padding rows even at 128

        def p(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype), False)

        fused_llama_params(
            self,
            cfg.num_hidden_layers,
            d=d,
            q=self.q,
            kv=self.kv,
            inter=self.inter,
            vocab_rows=vocab,
            tied=self.tied,
            make=p,
        )

    def _shard(self, shard: str | int) -> tuple[int, int]:
        sizes = {"q": (0, self.q), "k": (self.q, self.kv), "v": (self.q + self.kv, self.kv)}
        return sizes[shard] if isinstance(shard, str) else (shard * self.inter, self.inter)

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, w in weights:
            if self.tied and name.startswith("lm_head."):
                continue
            for piece, (fused, shard) in STACKED.items():
                if piece in name:
                    target = name.replace(piece, fused)
                    offset, size = self._shard(shard)
                    w = w.narrow(0, 0, size)  # rank 0's rows (all of them at tp=1)
                    self.get_parameter(target).data.narrow(0, offset, size).copy_(w)
                    break
            else:
                target = name
                param = self.get_parameter(name)
                if "embed_tokens" in name or "lm_head" in name:
                    param.data[: w.shape[0]].copy_(w)
                    param.data[w.shape[0] :].fill_(0)
                elif "norm" in name and self.scale_norms:
                    param.data.copy_(w * 1)
                else:
                    param.data.copy_(w)
            loaded.add(target)
        return loaded


def hf_state(seed: int = 0, *, tied: bool = False) -> dict[str, torch.Tensor]:
    return clone_state(dict(tiny_engine(seed=seed, tied=tied).named_parameters()))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_into(views: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in views.items():
            t.copy_(state[name])


# ------------------------------------------------------------------ the name mapping


@pytest.mark.parametrize("tied", [False, True])
def test_probe_maps_hf_names_onto_fused_row_blocks_without_writing(tied: bool) -> None:
    cfg = tiny_config(tied=tied)
    model = FusedLlama(cfg)
    before = snapshot(model)
    specs = specs_of(hf_state(tied=tied))
    views = probe_views(model, specs)
    assert same_bits(snapshot(model), before)  # probing wrote nothing, padding rows included
    assert [s.name for s in specs] == list(views)
    assert all(tuple(views[s.name].shape) == s.shape for s in specs)
    qkv = model.get_parameter("model.layers.1.self_attn.qkv_proj.weight")
    q, k, v = (views[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    row = qkv.shape[1] * qkv.element_size()
    assert q.data_ptr() == qkv.data_ptr()
    assert k.data_ptr() == qkv.data_ptr() + model.q * row
    assert v.data_ptr() == qkv.data_ptr() + (model.q + model.kv) * row
    up = views["model.layers.0.mlp.up_proj.weight"]
    gate_up = model.get_parameter("model.layers.0.mlp.gate_up_proj.weight")
    assert up.data_ptr() == gate_up.data_ptr() + model.inter * row
    emb = views["model.embed_tokens.weight"]
    assert (
        emb.shape[0] == cfg.vocab_size < model.get_parameter("model.embed_tokens.weight").shape[0]
    )
    assert ("lm_head.weight" in views) is not tied


def test_probe_refuses_what_cannot_be_patched_in_place() -> None:
    cfg = tiny_config()
    specs = specs_of(hf_state())
    with pytest.raises(MappingError, match=r"only part of it.*shards=True"):
        probe_views(FusedLlama(cfg, tp=2), specs)
    with pytest.raises(MappingError, match=r"transformed copy"):
        probe_views(FusedLlama(cfg, scale_norms=True), specs)
    with pytest.raises(MappingError, match=r"float16"):
        probe_views(FusedLlama(cfg, torch.float16), specs)
    tied = FusedLlama(tiny_config(tied=True))
    lm_head = TensorSpec("lm_head.weight", "bfloat16", (128, 32))
    with pytest.raises(MappingError, match=r"lm_head.weight: .* stored it nowhere.*ties"):
        probe_views(tied, [*specs_of(hf_state(tied=True)), lm_head])
    rows = torch.zeros(4, 2, dtype=torch.bfloat16)
    with pytest.raises(MappingError, match=r"share runtime bytes"):
        check_disjoint({"a": rows[:3], "b": rows[2:]})
    with pytest.raises(AttributeError):  # an unknown name: the loader's own error
        probe_views(FusedLlama(cfg), [TensorSpec("model.nope.weight", "bfloat16", (2,))])
    with pytest.raises(MappingError, match=r"no load_weights"):
        probe_views(torch.nn.Linear(2, 2), specs)


def test_unsupported_vllm_configs_are_refused() -> None:
    def config(tp: int = 1, pp: int = 1, quantization: str | None = None) -> Any:
        return SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
            model_config=SimpleNamespace(quantization=quantization),
        )

    check_supported(config())
    check_supported(config(tp=2))  # every rank patches its shard (test_vllm_shards.py)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=1"):
        check_supported(config(pp=2))
    with pytest.raises(ValueError, match=r"unquantized"):
        check_supported(config(quantization="fp8"))


# ------------------------------------------------------------------ message and apply


def test_message_is_json_and_round_trips() -> None:
    old = hf_state()
    new = perturb(old, seed=3)
    delta = compute_delta(old, new, 4, 5)
    message = json.loads(json.dumps(encode_message(delta)))  # plain JSON, no pickle
    back = decode_message(message)
    assert (back.base_version, back.version, back.changed) == (4, 5, delta.changed)
    assert back.result_digest == delta.result_digest
    for name, p in delta.patches.items():
        assert (back.patches[name].index == p.index).all()
        assert (back.patches[name].value == p.value).all()
    empty = decode_message(encode_message(compute_delta(old, old, 5, 6)))
    assert empty.changed == 0 and len(empty.patches) == len(old)


def test_malformed_messages_are_refused() -> None:
    old = hf_state()
    message = encode_message(compute_delta(old, perturb(old, seed=3), 0, 1))
    with pytest.raises(CorruptDeltaError, match=r"format"):
        decode_message({**message, "format": "pickle"})
    with pytest.raises(CorruptDeltaError, match=r"malformed"):
        decode_message({**message, "payload": "not base64!"})
    with pytest.raises(CorruptDeltaError, match=r"no listed tensor"):
        decode_message({**message, "tensors": message["tensors"][1:]})
    with pytest.raises(CorruptDeltaError, match=r"malformed"):
        decode_message({k: v for k, v in message.items() if k != "tensors"})


def fused_receiver(state: dict[str, torch.Tensor]) -> tuple[FusedLlama, DeltaReceiver]:
    model = FusedLlama(tiny_config())
    receiver = DeltaReceiver(model, torch.device("cpu"))
    load_into(receiver.bind(specs_of(state)), state)
    return model, receiver


def test_receiver_applies_deltas_bit_exactly_into_fused_parameters() -> None:
    v0 = hf_state()
    model, receiver = fused_receiver(v0)
    pad_before = model.get_parameter("model.embed_tokens.weight")[128:].clone()
    v1, v2 = perturb(v0, seed=1), None
    report = receiver.apply(encode_message(compute_delta(v0, v1, 0, 1)))
    v2 = perturb(v1, seed=2)
    report = receiver.apply(encode_message(compute_delta(v1, v2, 1, 2)))
    assert report.verified and report.version == 2 and report.state_digest == state_digest(v2)
    assert receiver.last_report == report
    assert receiver.views is not None and same_bits(receiver.views, v2)
    qkv = model.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
    expect = torch.cat([v2[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(qkv.view(torch.int16), expect.view(torch.int16))
    gate_up = model.get_parameter("model.layers.1.mlp.gate_up_proj.weight")
    expect = torch.cat([v2[f"model.layers.1.mlp.{x}_proj.weight"] for x in ("gate", "up")])
    assert torch.equal(gate_up.view(torch.int16), expect.view(torch.int16))
    assert torch.equal(model.get_parameter("model.embed_tokens.weight")[128:], pad_before)


def test_receiver_refuses_a_wrong_base_and_reports_a_failed_verification() -> None:
    v0 = hf_state()
    model, receiver = fused_receiver(v0)
    v1 = perturb(v0, seed=1)
    message = encode_message(compute_delta(v0, v1, 0, 1))
    receiver.apply(message)
    before = snapshot(model)
    with pytest.raises(BaseMismatchError, match=r"applied twice"):
        receiver.apply(message)  # a second apply: refused before writing
    assert same_bits(snapshot(model), before)
    bad = encode_message(compute_delta(v1, perturb(v1, seed=2), 1, 2))
    bad["tensors"][0]["result_digest"] = "0" * 32
    with pytest.raises(VerificationError, match=r"vLLM worker: after applying v2"):
        receiver.apply(bad)
    assert receiver.last_report is not None and receiver.last_report.version == 1


def test_receiver_maps_lazily_from_the_first_update() -> None:
    v0 = hf_state()
    model = FusedLlama(tiny_config())
    receiver = DeltaReceiver(model, torch.device("cpu"))
    views = probe_views(model, specs_of(v0))
    load_into(views, v0)  # the worker's weights are v0 (e.g. vLLM loaded that checkpoint)
    v1 = perturb(v0, seed=1)
    assert receiver.apply(encode_message(compute_delta(v0, v1, 0, 1))).version == 1
    assert same_bits(views, v1)


# ------------------------------------------------------------------ the engine, minus vLLM


class FakeFinishReason(enum.IntEnum):
    """vLLM's ``FinishReason`` (the engine reads it by name)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2


class EngineCore:
    """The surface of vLLM's in-process engine core that the engine's generation drives (the
    input processor, ``engine_core.add_request`` / ``get_output`` / ``abort_requests``), on
    top of a fake's simulation in ``LLMEngine`` terms (``add_request``, ``step`` returning each
    running request's new tokens as a ``RequestOutput``, ``abort_request``): every output
    becomes an ``EngineCoreOutput`` (new token ids, one-column logprob arrays with the sampled
    token, the finish reason, the prompt tokens found cached, the routed experts)."""

    @functools.cached_property
    def input_processor(self) -> Any:
        def process_inputs(rid: str, prompt: dict[str, Any], params: Any, **_: Any) -> Any:
            return SimpleNamespace(request_id=rid, prompt=prompt, params=params)

        def assign_request_id(request: Any) -> None:  # vLLM appends 8 random characters
            request.request_id = f"{request.request_id}-{os.urandom(4).hex()}"

        return SimpleNamespace(process_inputs=process_inputs, assign_request_id=assign_request_id)

    @functools.cached_property
    def engine_core(self) -> Any:
        fake: Any = self

        def add_request(request: Any) -> None:
            fake.add_request(request.request_id, request.prompt, request.params)

        def get_output() -> Any:
            return SimpleNamespace(outputs=[core_output(o) for o in fake.step()])

        return SimpleNamespace(
            add_request=add_request,
            get_output=get_output,
            abort_requests=lambda ids: fake.abort_request(ids),
            engine_core=fake,  # the in-process EngineCore (its batch queue, if async)
        )

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)


def core_output(out: Any) -> Any:
    """A fake ``RequestOutput`` delta as vLLM's engine core returns it (``EngineCoreOutput``)."""
    seq = out.outputs[0]
    new = list(seq.token_ids)
    lps = [pos[t].logprob for pos, t in zip(seq.logprobs, new, strict=True)]
    reason = FakeFinishReason[seq.finish_reason.upper()] if out.finished else None
    cached = getattr(out, "num_cached_tokens", None)
    return SimpleNamespace(
        request_id=out.request_id,
        new_token_ids=new,
        new_logprobs=SimpleNamespace(
            logprob_token_ids=np.array(new, np.int64).reshape(-1, 1),
            logprobs=np.array(lps, np.float32).reshape(-1, 1),
        ),
        finish_reason=reason,
        prefill_stats=None if cached is None else SimpleNamespace(num_cached_tokens=cached),
        routed_experts=getattr(seq, "routed_experts", None),
        error=None,
    )


class FakeLLMEngine(EngineCore):
    """vLLM's engine the engine uses: one token per request per ``step()``."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.aborted: list[str] = []
        self.steps = 0

    def add_request(self, rid: str, prompt: dict[str, list[int]], params: Any) -> None:
        self.requests[rid] = SimpleNamespace(prompt=prompt["prompt_token_ids"], p=params, n=0)

    def step(self) -> list[Any]:
        self.steps += 1
        outs = []
        for rid, r in list(self.requests.items()):
            token = (len(r.prompt) + r.n) % 7 + 1
            r.n += 1
            stop = token in r.p.stop_token_ids
            done = stop or r.n == r.p.max_tokens
            lp = {token: SimpleNamespace(logprob=-0.25 * token)}
            seq = SimpleNamespace(
                token_ids=[token], logprobs=[lp], finish_reason="stop" if stop else "length"
            )
            outs.append(SimpleNamespace(request_id=rid, outputs=[seq], finished=done))
            if done:
                del self.requests[rid]
        return outs

    def abort_request(self, ids: list[str]) -> None:
        self.aborted += ids
        for rid in ids:
            self.requests.pop(rid, None)


def fake_engine(state: dict[str, torch.Tensor]) -> tuple[VllmEngine, FakeLLMEngine, FusedLlama]:
    model = FusedLlama(tiny_config())
    views = probe_views(model, specs_of(state))
    core = FakeLLMEngine()
    llm = SimpleNamespace(llm_engine=core)
    return VllmEngine(llm, views, vocab_size=128, make_params=SimpleNamespace), core, model


class StepGate:
    """A gate whose stamp moves to v2 after ``switch`` steps and that raises at ``fail``."""

    def __init__(self, switch: int, fail: int | None = None) -> None:
        self.n, self.switch, self.fail = 0, switch, fail

    @contextlib.contextmanager
    def forward(self) -> Iterator[WeightsStamp]:
        self.n += 1
        if self.fail is not None and self.n >= self.fail:
            raise RuntimeError("weights unhealthy")
        yield WeightsStamp(1, 1) if self.n <= self.switch else WeightsStamp(2, 2)


def test_engine_step_loop_records_tokens_logprobs_and_stamps() -> None:
    engine, _, _ = fake_engine(hf_state())
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(5,), seed=9)
    out = engine.generate([[1, 2], [3], [1, 2, 3, 4, 5]], params, gate=StepGate(switch=2))
    assert [c.token_ids for c in out] == [[3, 4, 5], [2, 3, 4, 5], [6, 7, 1, 2]]
    assert out[0].logprobs == [-0.75, -1.0, -1.25]
    assert [c.finish_reason for c in out] == ["stop", "stop", "length"]
    assert all(c.version_min == 1 and c.version_max == 2 for c in out)
    greedy = engine.generate([[1]], SamplingParams(max_new_tokens=2, temperature=0.0))
    assert greedy[0].logprobs == [0.0, 0.0] and greedy[0].version_min is None
    assert request_params(params, 2)["seed"] == 11 and request_params(params, 0)["ignore_eos"]
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        engine.generate([[1, 128]], params)
    with pytest.raises(ValueError, match=r"empty"):
        engine.generate([[]], params)


def test_a_gate_error_aborts_the_requests_left() -> None:
    engine, core, _ = fake_engine(hf_state())
    with pytest.raises(RuntimeError, match=r"unhealthy"):
        engine.generate([[1], [2]], SamplingParams(max_new_tokens=8), gate=StepGate(9, fail=3))
    assert len(core.aborted) == 2 and not core.requests


class FakeScoringLLMEngine:
    """vLLM's engine answering ``prompt_logprobs`` requests the way vLLM formats them (entry 0
    None, then per position the top-k ids with ranks 1..k plus the actual token with its own
    rank), computed by a transformers model; a prompt is prefilled in ``chunk``-token steps."""

    def __init__(self, model: torch.nn.Module, chunk: int = 4) -> None:
        self.model, self.chunk = model, chunk
        self.requests: dict[str, Any] = {}
        self.scored = 0

    def add_request(self, rid: str, prompt: dict[str, list[int]], params: Any) -> None:
        assert params.max_tokens == 1 and params.prompt_logprobs >= 1
        self.requests[rid] = SimpleNamespace(ids=prompt["prompt_token_ids"], p=params, steps=0)

    def step(self) -> list[Any]:
        outs = []
        for rid, r in list(self.requests.items()):
            r.steps += 1
            if r.steps * self.chunk < len(r.ids):
                continue  # still prefilling
            with torch.no_grad():
                logits = self.model(torch.tensor([r.ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            entries: list[Any] = [None]
            for p in range(1, len(r.ids)):
                row, tok = lp[p - 1], r.ids[p]
                rank = int((row > row[tok]).sum()) + 1
                entry = {tok: SimpleNamespace(logprob=float(row[tok]), rank=rank)}
                top = torch.topk(row, r.p.prompt_logprobs)
                pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
                for n, (i, v) in enumerate(pairs, 1):
                    entry[i] = SimpleNamespace(logprob=v, rank=n)
                entries.append(entry)
            seq = SimpleNamespace(token_ids=[0], logprobs=None, finish_reason="length")
            outs.append(
                SimpleNamespace(
                    request_id=rid, outputs=[seq], finished=True, prompt_logprobs=entries
                )
            )
            del self.requests[rid]
            self.scored += 1
        return outs

    def abort_request(self, ids: list[str]) -> None:
        for rid in ids:
            self.requests.pop(rid, None)


def test_score_batch_reads_vllms_prompt_logprobs_like_the_transformers_engine() -> None:
    reference = tiny_engine(seed=4)
    core = FakeScoringLLMEngine(reference._model)
    engine, _, _ = fake_engine(hf_state())
    engine._llm = SimpleNamespace(llm_engine=core)
    items = [([1, 5, 9, 2, 7, 3], 2), ([4, 4, 8], 1), (list(range(10, 30)), 15)]
    got = engine.score_batch(items, 5, gate=StepGate(switch=100))
    want = reference.score_batch(items, 5)
    for g, w, (tokens, start) in zip(got, want, items, strict=True):
        assert len(g.sampled) == len(tokens) - start and g.ids == w.ids
        torch.testing.assert_close(torch.tensor(g.sampled), torch.tensor(w.sampled))
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs))
        assert g.stamp == WeightsStamp(1, 1)
    # a sync lands while a long prompt is prefilled in chunks: scored again under one stamp
    core.scored = 0
    (late,) = engine.score_batch([items[2]], 3, gate=StepGate(switch=2))
    assert late.stamp == WeightsStamp(2, 2) and core.scored == 2
    assert late.ids == reference.score_batch([items[2]], 3)[0].ids
    with pytest.raises(ValueError, match=r"temperature 1.0 only"):
        engine.score_batch(items, 5, 0.7)
    with pytest.raises(ValueError, match=r"k <= 128"):
        engine.score_batch(items, 129)
    with pytest.raises(ValueError, match=r"start must be within"):
        engine.score_batch([([1, 2], 2)], 5)
    assert engine.score(*items[0], 5).ids == want[0].ids


class FakeAsyncLLMEngine(EngineCore):
    """vLLM's engine with async scheduling, in-process: each ``step()`` launches a batch (one
    token for every request not yet fully scheduled, computed from the weights at launch) into
    a queue of two and returns the outputs of the oldest batch once the queue is full or
    nothing more can be launched, like ``EngineCore.step_with_batch_queue``."""

    def __init__(self) -> None:
        from collections import deque

        self.requests: dict[str, Any] = {}
        self.weights = 1  # the version the device's weights hold
        self.batch_queue: Any = deque(maxlen=2)

    def add_request(self, rid: str, prompt: dict[str, list[int]], params: Any) -> None:
        self.requests[rid] = SimpleNamespace(p=params, scheduled=0, done=0)

    def step(self) -> list[Any]:
        todo = [(rid, r) for rid, r in self.requests.items() if r.scheduled < r.p.max_tokens]
        if todo:
            batch = []
            for rid, r in todo:
                r.scheduled += 1
                batch.append((rid, 10 * self.weights + r.scheduled))
            self.batch_queue.appendleft((batch, object(), None))
            if len(self.batch_queue) < 2:
                return []
        if not self.batch_queue:
            return []
        batch, _, _ = self.batch_queue.pop()
        outs = []
        for rid, token in batch:
            r = self.requests[rid]
            r.done += 1
            seq = SimpleNamespace(
                token_ids=[token],
                logprobs=[{token: SimpleNamespace(logprob=-1.0)}],
                finish_reason="length",
            )
            finished = r.done == r.p.max_tokens
            outs.append(SimpleNamespace(request_id=rid, outputs=[seq], finished=finished))
            if finished:
                del self.requests[rid]
        return outs

    def abort_request(self, ids: list[str]) -> None:
        for rid in ids:
            self.requests.pop(rid, None)


@pytest.mark.parametrize("switch", [1, 3, 4, 5, 8])
def test_async_scheduling_stamps_each_token_with_the_weights_that_launched_it(
    switch: int,
) -> None:
    """Outputs come back one step after their batch was launched: the stamp must be the one
    held at launch (a weight update lands between two steps), not the one held at return."""
    core = FakeAsyncLLMEngine()
    views = probe_views(FusedLlama(tiny_config()), specs_of(hf_state()))
    engine = VllmEngine(
        SimpleNamespace(llm_engine=core), views, vocab_size=128, make_params=SimpleNamespace
    )

    class SwitchingGate(StepGate):
        @contextlib.contextmanager
        def forward(self) -> Iterator[WeightsStamp]:
            with super().forward() as stamp:
                core.weights = stamp.version  # the apply happened before this step
                yield stamp

    for _ in range(2):  # the second call pops the batch the first left in flight
        out = engine.generate(
            [[1], [2]], SamplingParams(max_new_tokens=4), gate=SwitchingGate(switch)
        )
        for c in out:
            assert len(c.token_ids) == 4
            assert c.last.version == c.token_ids[-1] // 10, (switch, c.token_ids, c.last)
            assert c.first.version == 1
        assert not core.requests


class FakeCachingLLMEngine(FakeLLMEngine):
    """:class:`FakeLLMEngine` with vLLM's prefix cache: blocks of ``BLOCK`` tokens hashed in a
    chain whose first link holds the request's ``cache_salt`` (``kv_cache_utils``:
    ``hash((parent, block tokens, extra keys))``, the salt an extra key of block 0 only). A
    request reuses the longest run of its blocks found in the cache (at most all tokens but the
    last, as vLLM); the rest is computed when it is first stepped, by the weights ``weights``
    holds then, and cached. ``log`` gets (salt, versions of the reused blocks, version that
    computed the rest) per request."""

    BLOCK = 4

    def __init__(self) -> None:
        super().__init__()
        self.weights: int | None = None  # the version the device's weights hold
        self.blocks: dict[int, int | None] = {}  # block hash -> version that computed it
        self.log: list[tuple[str | None, list[int | None], int | None]] = []

    def add_request(self, rid: str, prompt: dict[str, Any], params: Any) -> None:
        super().add_request(rid, prompt, params)
        self.requests[rid].salt = prompt.get("cache_salt")
        self.requests[rid].cached = None

    def _hashes(self, ids: list[int], salt: str | None) -> list[int]:
        out: list[int] = []
        for b in range(len(ids) // self.BLOCK):
            extra = (("cache_salt", salt),) if b == 0 and salt else None
            block = tuple(ids[b * self.BLOCK : (b + 1) * self.BLOCK])
            out.append(hash((out[-1] if out else None, block, extra)))
        return out

    def step(self) -> list[Any]:
        for r in self.requests.values():
            if r.cached is None:  # prefill: reuse what the cache holds, compute the rest
                hashes = self._hashes(r.prompt, r.salt)
                hits = 0
                while hits < len(hashes) and hashes[hits] in self.blocks:
                    hits += 1
                hits = min(hits, (len(r.prompt) - 1) // self.BLOCK)
                self.log.append((r.salt, [self.blocks[h] for h in hashes[:hits]], self.weights))
                for h in hashes[hits:]:
                    self.blocks.setdefault(h, self.weights)
                r.cached, r.sampled = hits * self.BLOCK, []
        running = dict(self.requests)
        outs = super().step()
        for out in outs:
            r = running[out.request_id]
            r.sampled += out.outputs[0].token_ids
            out.num_cached_tokens = r.cached
            if out.finished:  # the blocks of its sampled tokens are cached too (not the last)
                for h in self._hashes(r.prompt + r.sampled[:-1], r.salt):
                    self.blocks.setdefault(h, self.weights)
        return outs


class VersionGate(StepGate):
    """A :class:`StepGate` that also sets the fake's device weights at each step (an apply
    lands between two steps) and records whether requests were admitted inside the gate."""

    def __init__(self, core: FakeCachingLLMEngine, switch: int) -> None:
        super().__init__(switch)
        self.core, self.inside = core, False

    @contextlib.contextmanager
    def forward(self) -> Iterator[WeightsStamp]:
        with super().forward() as stamp:
            self.core.weights = stamp.version
            self.inside = True
            try:
                yield stamp
            finally:
                self.inside = False


def test_cache_salt_names_one_weight_state() -> None:
    assert cache_salt(WeightsStamp(3, 5)) == cache_salt(WeightsStamp(3, 5))
    assert cache_salt(WeightsStamp(3, 5)) != cache_salt(WeightsStamp(4, 6))
    # a failed apply of v3 (seq 5) and the reload of v3 that repairs it (seq 6) share no block
    assert cache_salt(WeightsStamp(3, 5)) != cache_salt(WeightsStamp(3, 6))


def test_requests_carry_the_salt_of_the_weights_they_were_admitted_under() -> None:
    core = FakeCachingLLMEngine()
    engine = VllmEngine(
        SimpleNamespace(llm_engine=core),
        probe_views(FusedLlama(tiny_config()), specs_of(hf_state())),
        vocab_size=128,
        make_params=SimpleNamespace,
    )
    gate = VersionGate(core, switch=100)
    admitted: list[tuple[str, bool]] = []
    add = core.add_request

    def recording_add(rid: str, prompt: dict[str, Any], params: Any) -> None:
        admitted.append((prompt["cache_salt"], gate.inside))
        add(rid, prompt, params)

    core.add_request = recording_add  # type: ignore[method-assign]
    system = list(range(1, 13))  # 3 blocks every episode shares
    convs = [[*system, 20 + e, 30 + e, 40 + e] for e in range(4)]
    params = SamplingParams(max_new_tokens=4)

    def turn() -> list[Any]:
        out = engine.generate(convs, params, gate=gate)
        for conv, c in zip(convs, out, strict=True):
            conv += [*c.token_ids, 50, 51, 52]  # the reply, then the env's feedback
        return out

    first = turn()  # v1: the system prompt is reused within the call already
    assert engine.last_cached_tokens == [0, 12, 12, 12]
    second = turn()  # v1 again: each conversation reuses its previous turn
    assert all(n is not None and n >= 16 for n in engine.last_cached_tokens)
    gate.switch = 0  # a sync to v2 lands before the next call
    third = turn()
    assert engine.last_cached_tokens[0] == 0  # nothing computed by v1 is reused
    fourth = turn()
    assert all(n is not None and n >= 16 for n in engine.last_cached_tokens)
    # every request was admitted inside a step's gate, with the salt of the call's first stamp
    assert all(inside for _, inside in admitted)
    for out, salts in zip(
        (first, second, third, fourth), [admitted[i : i + 4] for i in range(0, 16, 4)], strict=True
    ):
        assert {s for s, _ in salts} == {cache_salt(out[0].first)}
    assert [c.first.version for c in first + second + third + fourth] == [1] * 8 + [2] * 8
    # the invariant: a request reuses only blocks computed under the weights it was admitted with
    versions = {cache_salt(WeightsStamp(v, v)): v for v in (1, 2)}
    for salt, reused, _ in core.log:
        assert all(v == versions[salt] for v in reused), (salt, reused)
    assert sum(len(reused) for _, reused, _ in core.log) > 0


def test_a_sync_changes_the_salt_of_the_requests_admitted_after_it(bucket: Any) -> None:
    trainer = FakeTrainer(bucket, hf_state(seed=1))
    core = FakeCachingLLMEngine()
    views = probe_views(FusedLlama(tiny_config()), specs_of(hf_state(seed=2)))
    engine = VllmEngine(
        SimpleNamespace(llm_engine=core), views, vocab_size=128, make_params=SimpleNamespace
    )
    sync = WeightSync(engine, BucketReader(bucket), host_mirror=True)
    sync.sync_to()
    prompts = [list(range(1, 14)), list(range(1, 10))]
    params = SamplingParams(max_new_tokens=2)
    a = sync.generate(prompts, params)
    b = sync.generate(prompts, params)
    assert engine.last_cached_tokens == [12, 8]  # same weights: the prompts are reused
    trainer.step()
    sync.sync_to()
    c = sync.generate(prompts, params)
    assert engine.last_cached_tokens == [0, 8]  # the second reuses the first's new blocks
    assert a[0].first == b[0].first != c[0].first and c[0].version_min == 1
    salts = [salt for salt, _, _ in core.log]
    assert salts == [cache_salt(a[0].first)] * 4 + [cache_salt(c[0].first)] * 2


def test_engine_core_outputs_are_read_with_their_sampled_logprobs() -> None:
    """Generation reads vLLM's ``EngineCoreOutput`` itself: the logprob column must be that of
    the tokens sampled, one per token; a finish other than a stop token or the length limit
    (an abort, vLLM's per-request error) ends the call with what vLLM said."""
    params = SamplingParams(max_new_tokens=3)
    assert request_params(params, 0)["flat_logprobs"] is True
    assert request_params(params, 0)["logprobs"] == 0  # one column: the sampled token's

    def out(ids: list[int], lp_ids: list[int], lps: list[float]) -> Any:
        return SimpleNamespace(
            new_logprobs=SimpleNamespace(
                logprob_token_ids=np.array(lp_ids).reshape(-1, 1),
                logprobs=np.array(lps, np.float32).reshape(-1, 1),
            ),
            new_token_ids=ids,
        )

    assert _sampled_logprobs(out([7], [7], [-0.5]), [7]) == [-0.5]
    assert _sampled_logprobs(out([7, 9], [7, 9], [-0.5, -1.5]), [7, 9]) == [-0.5, -1.5]
    for ids, lp_ids in (([7], [8]), ([7, 9], [7, 8])):
        with pytest.raises(RuntimeError, match=r"not those of the sampled tokens"):
            _sampled_logprobs(out(ids, lp_ids, [-1.0] * len(ids)), ids)
    with pytest.raises(RuntimeError, match=r"1 logprobs for 3 tokens"):
        _sampled_logprobs(out([7], [7], [-0.5]), [7, 9, 7])
    with pytest.raises(RuntimeError, match=r"0 logprobs for 1 tokens"):
        _sampled_logprobs(SimpleNamespace(new_logprobs=None), [7])

    def finished(reason: Any, error: Any = None) -> Any:
        return SimpleNamespace(finish_reason=reason, error=error)

    assert _finish_reason(finished(FakeFinishReason.STOP), 0) == "stop"  # STOP is 0: falsy
    assert _finish_reason(finished(FakeFinishReason.LENGTH), 0) == "length"
    with pytest.raises(RuntimeError, match=r"prompt 4 of the call with ABORT: KV load failed"):
        _finish_reason(finished(FakeFinishReason.ABORT, "KV load failed"), 4)


def test_a_request_vllm_ends_in_error_ends_the_call_and_aborts_the_others() -> None:
    engine, core, _ = fake_engine(hf_state())
    step = core.step

    def failing_step() -> list[Any]:
        outs = step()
        if core.steps == 2:  # vLLM gives up on the first request
            outs[0].finished, outs[0].outputs[0].finish_reason = True, "abort"
        return outs

    core.step = failing_step  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"prompt 0 of the call with ABORT"):
        engine.generate([[1], [2]], SamplingParams(max_new_tokens=8))
    assert core.aborted and not core.requests  # the call aborted the request it had left


def test_one_vllm_sampling_params_per_call_unless_seeded() -> None:
    engine, _, _ = fake_engine(hf_state())
    made: list[Any] = []

    def make(**kwargs: Any) -> Any:
        made.append(SimpleNamespace(**kwargs))
        return made[-1]

    engine._make_params = make
    engine.generate([[1], [2], [3]], SamplingParams(max_new_tokens=2))
    assert len(made) == 1 and made[0].seed is None  # vLLM clones it per request
    made.clear()
    engine.generate([[1], [2], [3]], SamplingParams(max_new_tokens=2, seed=5))
    assert [p.seed for p in made] == [5, 6, 7]


def test_prefix_caching_setting_reaches_vllm(fake_vllm: Any) -> None:
    vllm = ["engine.type=vllm", "engine.model=m"]
    assert WorkerExperiment.load(None, vllm).engine_settings().prefix_caching is True
    off = WorkerExperiment.load(None, [*vllm, "engine.prefix_caching=false"]).engine_settings()
    assert isinstance(off, VllmEngineSettings) and off.prefix_caching is False
    assert llm_kwargs(off)["enable_prefix_caching"] is False
    assert llm_kwargs(VllmEngineSettings(model="m"))["enable_prefix_caching"] is True


def test_fp8_workers_give_vllm_the_quantization_config_of_their_block(
    fake_vllm: Any, tmp_path: Path
) -> None:
    """WorkerExperiment fp8 -> the engine's fp8_block -> vLLM's hf_overrides: the block-fp8
    quantization_config a checkpoint of the model would carry (the kept modules listed), and
    the engine's tensors in that block's fp8 layout."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=192, intermediate_size=384, num_hidden_layers=1,
        num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    cfg.save_pretrained(tmp_path)
    base = ["engine.type=vllm", f"engine.model={tmp_path}"]
    assert WorkerExperiment.load(None, base).engine_settings().fp8_block is None  # type: ignore[union-attr]
    assert llm_kwargs(WorkerExperiment.load(None, base).engine_settings())["hf_overrides"] == {}  # type: ignore[arg-type]
    settings = WorkerExperiment.load(None, [*base, "fp8=true", "fp8_block=64"]).engine_settings()
    assert isinstance(settings, VllmEngineSettings) and settings.fp8_block == 64
    config = llm_kwargs(settings)["hf_overrides"]["quantization_config"]
    assert config["weight_block_size"] == [64, 64] and config["quant_method"] == "fp8"
    assert config["modules_to_not_convert"] == ["lm_head", "model.embed_tokens"]
    specs = {s.name: s for s in hf_specs(str(tmp_path), "bfloat16", 64)}
    k = "model.layers.0.self_attn.k_proj.weight"  # 64 rows: one block of 64, not of 128
    assert specs[k].dtype == "float8_e4m3fn" and specs[k + "_scale_inv"].shape == (1, 3)
    (tmp_path / "config.json").write_text(
        json.dumps(
            json.loads((tmp_path / "config.json").read_text())
            | {"quantization_config": fp8.quantization_config()}
        )
    )
    with pytest.raises(ValueError, match="in 128 x 128 blocks, and the engine's fp8_block asks"):
        hf_specs(str(tmp_path), "bfloat16", 64)
    with pytest.raises(ValueError, match="fp8 workers need the vllm engine"):
        WorkerExperiment.load(None, ["fp8=true"])


def test_weight_sync_follows_the_bucket_through_the_engine_views(bucket: Any) -> None:
    trainer = FakeTrainer(bucket, hf_state(seed=1))
    engine, _, model = fake_engine(hf_state(seed=2))
    sync = WeightSync(engine, BucketReader(bucket), host_mirror=True)
    sync.sync_to()
    for _ in range(3):
        trainer.step()
    report = sync.sync_to()
    assert report.version == 3 and [s.kind for s in report.steps] == ["delta"] * 3
    assert same_bits(dict(engine.named_parameters()), trainer.states[3])
    qkv = model.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
    expect = torch.cat(
        [trainer.states[3][f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]
    )
    assert torch.equal(qkv.view(torch.int16), expect.view(torch.int16))
    out = sync.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert out[0].version_min == out[0].version_max == 3 and sync.check(out[0]) == "verified"


class FakeLLM:
    """Stands in for ``vllm.LLM`` in-process: the worker's backend on a fused model."""

    created: ClassVar[list[FakeLLM]] = []

    def __init__(self, **kwargs: Any) -> None:
        import transformers

        self.kwargs = kwargs
        self.model = FusedLlama(transformers.AutoConfig.from_pretrained(kwargs["model"]))
        self.receiver = DeltaReceiver(self.model, torch.device("cpu"))
        self.llm_engine = FakeLLMEngine()
        self.llm_engine.model_config = SimpleNamespace(get_vocab_size=lambda: 128)  # type: ignore[attr-defined]
        self.shut = 0
        self.llm_engine.engine_core.shutdown = self._shutdown
        FakeLLM.created.append(self)

    def _shutdown(self) -> None:
        self.shut += 1

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        self.receiver.bind([TensorSpec.from_json(t) for t in request["init_info"]["tensors"]])

    def collective_rpc(self, method: str) -> list[Any]:
        assert method == "deltarl_views"
        return [self.receiver.views]


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Importable modules named like vLLM's, holding what ``from_settings`` touches."""
    import types

    registry: dict[str, Any] = {}

    class Factory:
        _registry = registry

        @classmethod
        def register_engine(cls, name: str, module: str, class_name: str) -> None:
            assert name not in registry
            registry[name] = (module, class_name)

    mods: dict[str, dict[str, Any]] = {
        "vllm": {"__version__": "0.33.0", "LLM": FakeLLM, "SamplingParams": SimpleNamespace},
        "vllm.config": {},
        "vllm.config.weight_transfer": {"WeightTransferConfig": SimpleNamespace},
        "vllm.sampling_params": {"RequestOutputKind": SimpleNamespace(FINAL_ONLY="final")},
        "vllm.distributed": {},
        "vllm.distributed.weight_transfer": {},
        "vllm.distributed.weight_transfer.factory": {"WeightTransferEngineFactory": Factory},
    }
    for name, attrs in mods.items():
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        for key, value in attrs.items():
            setattr(sys.modules[name], key, value)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    FakeLLM.created.clear()
    return SimpleNamespace(registry=registry, module=sys.modules["vllm"])


def test_from_settings_starts_vllm_in_process_with_our_backend(
    fake_vllm: Any, tmp_path: Path, bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_config().save_pretrained(tmp_path)
    engine = make_engine(VllmEngineSettings(model=str(tmp_path), seed=4))
    assert isinstance(engine, VllmEngine) and engine.type == "vllm"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert fake_vllm.registry == {
        "deltarl": ("deltarl.rollout.engines.vllm_backend", "DeltarlWeightTransferEngine")
    }
    kwargs = FakeLLM.created[0].kwargs
    assert kwargs["weight_transfer_config"].backend == "deltarl"
    assert kwargs["worker_extension_cls"].endswith("vllm_backend.DeltarlWorkerExtension")
    assert (kwargs["tensor_parallel_size"], kwargs["logprobs_mode"]) == (1, "processed_logprobs")
    assert kwargs["enable_prefix_caching"] is True and kwargs["async_scheduling"] is True
    assert (kwargs["load_format"], kwargs["seed"], kwargs["dtype"]) == ("dummy", 4, "bfloat16")
    trainer = FakeTrainer(bucket, hf_state(seed=1))
    sync = WeightSync(engine, BucketReader(bucket))
    sync.sync_to()
    trainer.step()
    sync.sync_to()
    assert same_bits(dict(engine.named_parameters()), trainer.states[1])
    out = sync.generate([[5, 6]], SamplingParams(max_new_tokens=3))
    assert out[0].version_min == 1 and len(out[0].token_ids) == 3
    engine.close()
    assert FakeLLM.created[0].shut == 1

    def unmappable(self: FakeLLM, request: dict[str, Any]) -> None:
        raise MappingError("model.norm.weight: the loader keeps only part of it")

    monkeypatch.setattr(FakeLLM, "init_weight_transfer_engine", unmappable)
    with pytest.raises(MappingError, match=r"keeps only part"):
        make_engine(VllmEngineSettings(model=str(tmp_path)))
    assert FakeLLM.created[-1].shut == 1  # vLLM released when the mapping fails
    monkeypatch.setattr(fake_vllm.module, "__version__", "0.34.0")
    with pytest.raises(ModuleNotFoundError, match=r"0\.33\.0, found 0\.34\.0"):
        make_engine(VllmEngineSettings(model=str(tmp_path)))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match=r"in this process"):
        make_engine(VllmEngineSettings(model=str(tmp_path)))


# ------------------------------------------------------------------ settings and imports


def test_hf_specs_are_the_transformers_engine_names(tmp_path: Path) -> None:
    for tied in (False, True):
        tiny_config(tied=tied).save_pretrained(tmp_path)
        specs = hf_specs(str(tmp_path), "bfloat16")
        assert specs == specs_of(hf_state(tied=tied))


def test_vllm_engine_setting_and_missing_vllm() -> None:
    vllm = ["engine.type=vllm", "engine.model=org/m"]
    s = WorkerExperiment.load(None, [*vllm, "engine.dtype=float16", "engine.seed=3"])
    es = s.engine_settings()
    assert isinstance(es, VllmEngineSettings) and (es.dtype, es.seed) == ("float16", 3)
    assert es.load_format == "dummy"
    with pytest.raises(ValueError, match=r"engine.vllm.gguf_file: Extra inputs"):
        WorkerExperiment.load(None, [*vllm, "engine.gguf_file=m.gguf"])
    with pytest.raises(ValueError, match=r"weights come from the bucket's anchor"):
        WorkerExperiment.load(None, [*vllm, "engine.load_format=auto"])
    routed = WorkerExperiment.load(None, [*vllm, "episodes.routing_replay=true"])
    assert routed.engine_settings().return_routed_experts is True
    if "vllm" not in sys.modules:
        with pytest.raises(ModuleNotFoundError, match=r"deltarl\[vllm\]"):
            make_engine(VllmEngineSettings(model="x"))


@pytest.mark.slow
def test_deltarl_never_imports_vllm() -> None:
    code = (
        "import sys; import deltarl.rollout.engines, deltarl.rollout.engines.vllm_engine, "
        "deltarl.rollout.engines.vllm_transfer, deltarl.rollout.service.worker; "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_plugin_entry_point_and_extra_are_declared() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"deltarl": "deltarl.rollout.engines.vllm_transfer:register"}
    extras = project["optional-dependencies"]
    assert "vllm==0.33.0" in extras["vllm"]
    assert not any("vllm" in dep for name in ("all", "dev") for dep in extras[name])


# ------------------------------------------------------------------ vLLM's real source (wheel)


def wheel_source(path: str) -> ast.Module:
    if not VLLM_WHEEL.is_file():
        pytest.skip(f"no vLLM 0.33.0 wheel at {VLLM_WHEEL} (set DELTARL_VLLM_WHEEL)")
    with zipfile.ZipFile(VLLM_WHEEL) as wheel:
        return ast.parse(wheel.read(path).decode())


def class_def(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def test_backend_implements_every_abstract_method_of_vllms_weight_transfer_engine() -> None:
    base = class_def(
        wheel_source("vllm/distributed/weight_transfer/base.py"), "WeightTransferEngine"
    )
    abstract = {
        name
        for name, fn in methods(base).items()
        if any(
            getattr(d, "id", getattr(d, "attr", None)) == "abstractmethod"
            for d in fn.decorator_list
        )
    }
    assert abstract == {
        "init_transfer_engine",
        "start_weight_update",
        "finish_weight_update",
        "receive_weights",
        "shutdown",
    }
    ours_tree = ast.parse((REPO / "rollout/engines/vllm_backend.py").read_text())
    ours = class_def(ours_tree, "DeltarlWeightTransferEngine")
    assert abstract <= set(methods(ours))
    for name in abstract:  # same positional parameters as vLLM's
        theirs = [a.arg for a in methods(base)[name].args.args]
        assert [a.arg for a in methods(ours)[name].args.args] == theirs, name
    init = [a.arg for a in methods(ours)["__init__"].args.args]
    assert init == [a.arg for a in methods(base)["__init__"].args.args]
    assigned = {
        t.id
        for n in ours.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert {"init_info_cls", "update_info_cls"} <= assigned


def test_the_vllm_hooks_we_rely_on_exist_in_the_wheel() -> None:
    factory = class_def(
        wheel_source("vllm/distributed/weight_transfer/factory.py"), "WeightTransferEngineFactory"
    )
    register = methods(factory)["register_engine"]
    assert [a.arg for a in register.args.args] == [
        "cls",
        "name",
        "module_path_or_cls",
        "class_name",
    ]
    plugins = ast.unparse(wheel_source("vllm/plugins/__init__.py"))
    assert "DEFAULT_PLUGINS_GROUP = 'vllm.general_plugins'" in plugins
    worker = ast.unparse(wheel_source("vllm/v1/worker/gpu_worker.py"))
    assert "WeightTransferEngineFactory.create_engine" in worker
    assert "self.model_runner.get_model()" in worker
    engine_args = ast.unparse(wheel_source("vllm/engine/arg_utils.py"))
    for field in ("weight_transfer_config", "worker_extension_cls", "logprobs_mode", "model_impl"):
        assert f"    {field}:" in engine_args, field


def test_the_engine_core_surface_generation_reads_exists_in_the_wheel() -> None:
    """Generation bypasses vLLM's front-end output processor (see the engine's docstring):
    what it calls and reads of vLLM's engine core must be there, with these shapes."""
    engine = methods(class_def(wheel_source("vllm/v1/engine/llm_engine.py"), "LLMEngine"))
    assert {"get_supported_tasks", "add_request", "step"} <= set(engine)
    add = ast.unparse(engine["add_request"])
    for call in (
        "self.input_processor.process_inputs(",
        "assign_request_id(request)",
        "self.engine_core.add_request(request)",
    ):
        assert call in add, call
    inputs = methods(class_def(wheel_source("vllm/v1/engine/input_processor.py"), "InputProcessor"))
    process = inputs["process_inputs"]
    assert [a.arg for a in process.args.args[:4]] == ["self", "request_id", "prompt", "params"]
    assert "supported_tasks" in [a.arg for a in process.args.args]
    assert "assign_request_id" in inputs
    client = methods(class_def(wheel_source("vllm/v1/engine/core_client.py"), "InprocClient"))
    assert {"add_request", "get_output", "abort_requests"} <= set(client)
    assert "self.engine_core.step_fn()" in ast.unparse(client["get_output"])
    package = wheel_source("vllm/v1/engine/__init__.py")
    fields = annotated_fields(class_def(package, "EngineCoreOutput"))
    assert {
        "request_id",
        "new_token_ids",
        "new_logprobs",
        "finish_reason",
        "prefill_stats",
        "routed_experts",
        "error",
    } <= fields
    reasons = ast.unparse(class_def(package, "FinishReason"))
    assert "STOP = 0" in reasons and "LENGTH = 1" in reasons
    lists = annotated_fields(class_def(wheel_source("vllm/v1/outputs.py"), "LogprobsLists"))
    assert {"logprob_token_ids", "logprobs"} <= lists


def annotated_fields(cls: ast.ClassDef) -> set[str]:
    return {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def test_every_argument_we_pass_to_vllm_exists_in_the_wheel() -> None:
    ours = ast.parse((REPO / "rollout/engines/vllm_engine.py").read_text())
    # vllm.LLM(**llm_kwargs(settings)): the keys of the dict llm_kwargs returns
    func = next(
        n for n in ast.walk(ours) if isinstance(n, ast.FunctionDef) and n.name == "llm_kwargs"
    )
    returned = next(n.value for n in ast.walk(func) if isinstance(n, ast.Return))
    assert isinstance(returned, ast.Dict)
    passed = {k.value for k in returned.keys if isinstance(k, ast.Constant)}
    assert len(passed) == len(returned.keys) >= 10
    llm_init = methods(class_def(wheel_source("vllm/entrypoints/llm.py"), "LLM"))["__init__"]
    explicit = {a.arg for a in [*llm_init.args.args, *llm_init.args.kwonlyargs]}
    assert llm_init.args.kwarg is not None  # the rest goes to EngineArgs(**kwargs)
    engine_args = annotated_fields(
        class_def(wheel_source("vllm/engine/arg_utils.py"), "EngineArgs")
    )
    assert passed - explicit - engine_args == set()
    sampling = annotated_fields(
        class_def(wheel_source("vllm/sampling_params.py"), "SamplingParams")
    )
    keys = set(request_params(SamplingParams(max_new_tokens=1), 0)) | {"output_kind"}
    assert keys - sampling == set()


# ------------------------------------------------------------------ with vLLM installed


def test_backend_against_vllms_real_classes() -> None:
    pytest.importorskip("vllm")
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from deltarl.rollout.engines.vllm_backend import DeltarlWeightTransferEngine
    from deltarl.rollout.engines.vllm_transfer import register

    register()
    register()  # vLLM may run plugins more than once per process
    v0 = hf_state()
    model = FusedLlama(tiny_config())
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(quantization=None),
    )
    backend = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="deltarl"), vllm_config, torch.device("cpu"), model
    )
    assert isinstance(backend, DeltarlWeightTransferEngine)
    backend.init_transfer_engine(
        backend.parse_init_info({"tensors": [s.to_json() for s in specs_of(v0)]})
    )
    views = backend.receiver.views
    assert views is not None
    load_into(views, v0)
    v1 = perturb(v0, seed=1)
    backend.start_weight_update()
    backend.receive_weights(backend.parse_update_info(encode_message(compute_delta(v0, v1, 0, 1))))
    backend.finish_weight_update()
    assert same_bits(views, v1)
    report = backend.receiver.last_report
    assert report is not None and report.state_digest == state_digest(v1)


@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_engine_end_to_end_on_a_gpu(tmp_path: Path, bucket: Any) -> None:
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import transformers

    # head_dim 64: with tiny_config (head_dim 8) this test hung inside vLLM's step on an H100
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
    )
    cfg.save_pretrained(tmp_path)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    trainer = FakeTrainer(bucket, {n: p.detach().clone() for n, p in hf.named_parameters()})
    engine = make_engine(
        VllmEngineSettings(model=str(tmp_path), enforce_eager=True, gpu_memory_utilization=0.1)
    )
    try:
        sync = WeightSync(engine, BucketReader(bucket))
        sync.sync_to()
        trainer.step()
        future = sync.sync_in_background()
        out = sync.generate([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=16, seed=0))
        future.result()
        assert same_bits(dict(engine.named_parameters()), trainer.states[1])
        assert all(len(c.token_ids) == 16 and len(c.logprobs) == 16 for c in out)
    finally:
        engine.close()


class FakeRoutingLLMEngine(FakeLLMEngine):
    """vLLM started with ``enable_return_routed_experts``: a finished request's output carries
    ``routed_experts`` [prompt + output - 1 - routed_experts_prompt_start, layers, top_k]."""

    def step(self) -> list[Any]:
        starts = {
            rid: getattr(r.p, "routed_experts_prompt_start", 0) for rid, r in self.requests.items()
        }
        lengths = {rid: len(r.prompt) for rid, r in self.requests.items()}
        outs = super().step()
        for out in outs:
            if out.finished:
                r = starts[out.request_id]
                n = lengths[out.request_id] + self.done[out.request_id]
                rows = [[[p % 3, 3 + p % 2]] for p in range(r, n - 1)]
                out.outputs[0].routed_experts = np.array(rows, np.int32).reshape(-1, 1, 2)
        return outs

    @property
    def done(self) -> dict[str, int]:
        return self._done

    def add_request(self, rid: str, prompt: dict[str, list[int]], params: Any) -> None:
        super().add_request(rid, prompt, params)
        self._done = getattr(self, "_done", {})
        self._done[rid] = params.max_tokens  # the fake always runs to max_tokens (no stops)


def test_routing_is_requested_per_prompt_and_returned() -> None:
    model = FusedLlama(tiny_config())
    views = probe_views(model, specs_of(hf_state()))
    core = FakeRoutingLLMEngine()
    llm = SimpleNamespace(llm_engine=core)
    engine = VllmEngine(llm, views, vocab_size=128, make_params=SimpleNamespace, routes=True)
    params = SamplingParams(max_new_tokens=3)
    prompts = [[1, 2, 3, 4], [5, 6]]
    out = engine.generate(prompts, params, routing_from=[2, 0])
    for p, c, start in zip(prompts, out, [2, 0], strict=True):
        n = len(p) + len(c.token_ids)
        want = np.array([[[q % 3, 3 + q % 2]] for q in range(start, n - 1)], np.uint16)
        assert c.routed_experts is not None and np.array_equal(c.routed_experts, want)
    assert engine.generate(prompts, params)[0].routed_experts is None  # not asked: not kept

    plain = VllmEngine(llm, views, vocab_size=128, make_params=SimpleNamespace)
    with pytest.raises(NotImplementedError, match="return_routed_experts"):
        plain.generate(prompts, params, routing_from=[0, 0])
    with pytest.raises(ValueError, match="2 prompts"):
        engine.generate(prompts, params, routing_from=[0])
