"""Tensor parallelism for the vllm engine on CPU (docs/vllm.md, rollout/engines/vllm_shards.py).

A model laid out like one rank of vLLM's Llama at tensor parallelism ``tp`` (column-parallel
fused ``qkv_proj`` with grouped KV heads, replicated when there are fewer KV heads than ranks;
fused ``gate_up_proj``; row-parallel ``o_proj``/``down_proj`` split by input columns;
vocabulary-parallel embedding and LM head padded to 64 rows, the last rank holding fewer real
rows; tied embeddings; replicated norms) with a loader in vLLM's style (``narrow`` then
``copy_``, written for the test). The reference is what that loader actually writes from full
tensors: every rank's view of a tensor must hold its box of the full tensor, and a delta sliced
per rank must leave each rank's parameters equal to a fresh rank loaded with the full new state.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from rollout_helpers import FakeTrainer, clone_state, fused_llama_params, perturb
from safetensors.torch import save as st_save

from deltarl.rollout.engines.base import (
    Completion,
    Engine,
    SamplingParams,
    WeightsGate,
)
from deltarl.rollout.engines.vllm_mapping import MappingError, probe_shards, specs_of
from deltarl.rollout.engines.vllm_shards import (
    Box,
    ShardedWeights,
    ShardServer,
    box_of,
    connect,
    decode_delta,
    encode_delta,
    new_key,
    shard_delta,
)
from deltarl.rollout.sync.weights import WeightSync
from deltarl.weightsync.delta import apply_staged, compute_delta, stage_delta
from deltarl.weightsync.errors import StateMismatchError
from deltarl.weightsync.proof import ProofSpec, proof_answer
from deltarl.weightsync.reader import BucketReader

VOCAB = 100  # padded to 128: the last rank holds fewer real rows than the others


def config(*, tied: bool = False, kv_heads: int = 2) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )


def full_state(cfg: transformers.LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class RankLlama(torch.nn.Module):
    """Rank ``rank`` of ``tp`` of vLLM's Llama, random weights (``load_format="dummy"``)."""

    def __init__(self, cfg: transformers.LlamaConfig, tp: int, rank: int, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed + rank)
        d, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        hd = d // heads
        self.tp, self.rank, self.tied = tp, rank, cfg.tie_word_embeddings
        self.q = heads // tp * hd
        self.kv_replicas = max(1, tp // kv_heads)
        self.kv = max(1, kv_heads // tp) * hd
        self.inter = cfg.intermediate_size // tp
        padded = -(-cfg.vocab_size // 64) * 64
        self.per_rank = padded // tp
        start = rank * self.per_rank
        self.vocab_rows = (start, max(0, min(start + self.per_rank, cfg.vocab_size) - start))

        def p(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(shape, generator=g).to(torch.bfloat16), False)

        fused_llama_params(
            self,
            cfg.num_hidden_layers,
            d=d,
            q=self.q,
            kv=self.kv,
            inter=self.inter,
            vocab_rows=self.per_rank,
            tied=self.tied,
            make=p,
        )

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        r = self.rank
        for name, w in weights:
            if self.tied and name.startswith("lm_head."):
                continue
            if ".q_proj." in name or ".k_proj." in name or ".v_proj." in name:
                target = name.replace(name.split(".")[-2], "qkv_proj")
                param = self.get_parameter(target).data
                if ".q_proj." in name:
                    param.narrow(0, 0, self.q).copy_(w.narrow(0, r * self.q, self.q))
                else:
                    head = r // self.kv_replicas  # replicated KV heads when heads < ranks
                    at = self.q if ".k_proj." in name else self.q + self.kv
                    param.narrow(0, at, self.kv).copy_(w.narrow(0, head * self.kv, self.kv))
            elif ".gate_proj." in name or ".up_proj." in name:
                target = name.replace(name.split(".")[-2], "gate_up_proj")
                at = 0 if ".gate_proj." in name else self.inter
                self.get_parameter(target).data.narrow(0, at, self.inter).copy_(
                    w.narrow(0, r * self.inter, self.inter)
                )
            elif ".o_proj." in name or ".down_proj." in name:  # row parallel: input columns
                target, param = name, self.get_parameter(name).data
                k = param.shape[1]
                param.copy_(w.narrow(1, r * k, k))
            elif "embed_tokens" in name or "lm_head" in name:
                target, param = name, self.get_parameter(name).data
                start, size = self.vocab_rows
                param[:size].copy_(w.narrow(0, start, size))
                param[size:].fill_(0)
            else:
                target = name
                self.get_parameter(name).data.copy_(w)
            loaded.add(target)
        return loaded


def ranks(cfg: transformers.LlamaConfig, tp: int, seed: int = 7) -> list[RankLlama]:
    return [RankLlama(cfg, tp, r, seed) for r in range(tp)]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def bits_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a
    )


# ------------------------------------------------------------------ boxes


def test_box_of_reads_the_narrowed_part_and_refuses_anything_else() -> None:
    probe = torch.empty(6, 8, dtype=torch.bfloat16)
    assert box_of(probe, probe) == Box.full((6, 8))
    assert box_of(probe.narrow(0, 2, 3), probe) == Box((6, 8), (2, 0), (3, 8))
    assert box_of(probe.narrow(1, 4, 4), probe) == Box((6, 8), (0, 4), (6, 4))
    assert box_of(probe.narrow(0, 5, 1).narrow(1, 3, 2), probe) == Box((6, 8), (5, 3), (1, 2))
    assert box_of(probe.t(), probe) is None  # transposed
    assert box_of(probe[:, ::2], probe) is None  # strided
    assert box_of(probe.clone(), probe) is None  # a copy
    assert box_of(probe.view(48), probe) is None  # reshaped
    assert box_of(probe.narrow(0, 0, 0), probe) is None  # empty
    with pytest.raises(ValueError, match="outside"):
        Box((4,), (3,), (2,))


@pytest.mark.parametrize(
    "box",
    [
        Box((7, 9, 5), (2, 3, 1), (4, 5, 3)),  # a general box: coordinate by coordinate
        Box((7, 9, 5), (2, 0, 0), (4, 9, 5)),  # row blocks: one range, binary search
        Box((7, 9, 5), (6, 0, 0), (1, 9, 5)),  # the last row
        Box((7, 9, 5), (0, 0, 2), (7, 9, 3)),  # trailing columns
    ],
)
def test_localize_matches_slicing_a_full_tensor(box: Box) -> None:
    g = torch.Generator().manual_seed(0)
    full = torch.arange(7 * 9 * 5).reshape(7, 9, 5)
    index = np.sort(torch.randperm(full.numel(), generator=g)[:120].numpy())
    which, local = box.localize(index)
    sliced = box.take(full).reshape(-1)
    # the elements whose flat index is in the box are exactly those of the sliced tensor
    inside = np.isin(np.arange(full.numel()), full[box.slices()].reshape(-1).numpy())
    assert np.array_equal(index[which], index[inside[index]])
    got = sliced[torch.from_numpy(local)]
    assert torch.equal(got, full.reshape(-1)[torch.from_numpy(index[which])])
    assert np.all(np.diff(local) > 0)  # still strictly increasing


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 2), (4, 2), (2, 1)])
@pytest.mark.parametrize("tied", [False, True])
def test_probe_boxes_are_what_each_ranks_loader_writes(tp: int, kv_heads: int, tied: bool) -> None:
    cfg = config(tied=tied, kv_heads=kv_heads)
    state = full_state(cfg)
    specs = specs_of(state)
    for model in ranks(cfg, tp):
        before = snapshot(model)
        views, boxes = probe_shards(model, specs)
        assert bits_equal(snapshot(model), before)  # probing wrote nothing, padding included
        model.load_weights(state.items())  # the loader's real writes
        for name, view in views.items():
            assert torch.equal(
                view.view(torch.int16), boxes[name].take(state[name]).view(torch.int16)
            ), name
        r, hd = model.rank, 8
        q = boxes["model.layers.0.self_attn.q_proj.weight"]
        assert q.start == (r * 32 // tp, 0) and q.size == (32 // tp, 32)
        k = boxes["model.layers.1.self_attn.k_proj.weight"]
        kv = max(1, kv_heads // tp) * hd
        assert k.start == (r // max(1, tp // kv_heads) * kv, 0) and k.size == (kv, 32)
        o = boxes["model.layers.0.self_attn.o_proj.weight"]
        assert o.start == (0, r * 32 // tp) and o.size == (32, 32 // tp)  # input columns
        assert boxes["model.norm.weight"].is_full
        emb = boxes["model.embed_tokens.weight"]
        per = 128 // tp
        assert emb.start == (r * per, 0) and emb.size == (min(per, VOCAB - r * per), 32)
        assert ("lm_head.weight" in boxes) is not tied
        emb_param = model.get_parameter("model.embed_tokens.weight")
        assert not emb_param[emb.size[0] :].any()  # last rank's padding rows: zero
    with pytest.raises(MappingError, match="only part"):
        probe_shards(ranks(cfg, tp)[0], specs, shards=False)


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 2), (4, 2)])
@pytest.mark.parametrize("tied", [False, True])
def test_sliced_deltas_leave_every_rank_as_if_loaded_with_the_new_state(
    tp: int, kv_heads: int, tied: bool
) -> None:
    cfg = config(tied=tied, kv_heads=kv_heads)
    old = full_state(cfg, seed=1)
    new = perturb(old, seed=5, density=0.1)
    new["model.norm.weight"] = old["model.norm.weight"].clone()  # a tensor left unchanged
    delta = compute_delta(old, new, base_version=0, version=1)
    expected = ranks(cfg, tp, seed=9)
    for model in expected:
        model.load_weights(new.items())
    specs = specs_of(old)
    for model, want in zip(ranks(cfg, tp), expected, strict=True):
        views, boxes = probe_shards(model, specs)
        model.load_weights(old.items())
        local = shard_delta(delta, boxes)
        # through the wire encoding, as the rank receives it
        local = decode_delta(encode_delta(local), local.base_version, local.version)
        staged = stage_delta(local, "cpu", views)
        apply_staged(views, staged)
        got, exp = snapshot(model), snapshot(want)
        for name in got:  # padding rows were zero in both (the loader's fill_)
            assert torch.equal(got[name].view(torch.int16), exp[name].view(torch.int16)), name
    _, boxes = probe_shards(ranks(cfg, tp)[0], specs)
    boxes.pop("model.norm.weight")
    with pytest.raises(StateMismatchError, match="no rank holds"):
        shard_delta(delta, boxes)


# ------------------------------------------------------------------ shards through sockets


class ShardedEngine(Engine):
    """An engine whose weights are ``tp`` ranks' shards behind :class:`ShardServer` threads
    (the rollout worker's view of vLLM at TP > 1, on CPU)."""

    type = "vllm"

    def __init__(self, cfg: transformers.LlamaConfig, tp: int, tmp: Any) -> None:
        self.models = ranks(cfg, tp)
        self.initial = [snapshot(m) for m in self.models]  # padding rows must stay as they are
        specs = specs_of(full_state(cfg))
        key = new_key()
        self.servers, boxes = [], []
        for r, model in enumerate(self.models):
            views, b = probe_shards(model, specs)
            self.servers.append(ShardServer(views, torch.device("cpu"), f"{tmp}/rank.{r}", key))
            boxes.append(b)
        conns = connect([f"{tmp}/rank.{r}" for r in range(tp)], key)
        self.calls: list[str] = []

        def rpc(method: str, *args: Any) -> list[Any]:
            self.calls.append(method)
            assert method == "deltarl_tp_apply"
            return [s.apply(*args) for s in self.servers]

        self.shards = ShardedWeights({s.name: (s.dtype, s.shape) for s in specs}, boxes, conns, rpc)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def named_parameters(self) -> Mapping[str, torch.Tensor]:
        raise RuntimeError("sharded")

    def sharded_weights(self) -> ShardedWeights:
        return self.shards

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        gate: WeightsGate | None = None,
    ) -> list[Completion]:
        assert gate is not None
        with gate.forward() as stamp:
            return [Completion([1], [0.0], "length", stamp, stamp) for _ in prompts]

    def close(self) -> None:
        self.shards.close()
        for s in self.servers:
            s.close()


@pytest.fixture
def sharded(tmp_path: Any) -> Iterator[tuple[ShardedEngine, transformers.LlamaConfig]]:
    cfg = config(tied=True)
    engine = ShardedEngine(cfg, 2, tmp_path)
    yield engine, cfg
    engine.close()


def test_weight_sync_follows_a_bucket_into_every_ranks_shards(sharded: Any, bucket: Any) -> None:
    engine, cfg = sharded
    trainer = FakeTrainer(bucket, full_state(cfg, seed=3))
    sync = WeightSync(engine, BucketReader(bucket), host_mirror=None)
    assert sync.host_mirror  # forced: shards verify against the mirror
    sync.sync_to()
    for _ in range(3):
        trainer.step()
    report = sync.sync_to()
    assert report.version == 3 and [s.kind for s in report.steps] == ["delta"] * 3
    assert engine.calls == ["deltarl_tp_apply"] * 4  # anchor + 3 deltas, one call each
    for model, initial in zip(engine.models, engine.initial, strict=True):
        want = RankLlama(cfg, 2, model.rank, seed=99)  # as if loaded with the trainer's state
        want.load_weights(trainer.states[3].items())
        got, exp = snapshot(model), snapshot(want)
        rows = model.vocab_rows[1]
        emb = "model.embed_tokens.weight"
        exp[emb][rows:] = initial[emb][rows:]  # padding: never written (the loader zeroes it)
        assert bits_equal(got, exp)
    out = sync.generate([[1]], SamplingParams(max_new_tokens=1))
    assert out[0].version_max == 3 and sync.check(out[0]) == "verified"
    # proofs are answered from the host mirror (verified equal to every shard)
    spec = ProofSpec(chunks=0)
    nonce = bytes(range(32))
    assert sync.prove(3, nonce, spec) == proof_answer(trainer.states[3], nonce, 3, spec)


def test_a_corrupted_shard_fails_verification(sharded: Any, bucket: Any) -> None:
    engine, cfg = sharded
    trainer = FakeTrainer(bucket, full_state(cfg, seed=3))
    sync = WeightSync(engine, BucketReader(bucket), max_attempts=1)
    sync.sync_to()
    trainer.step()
    real_apply = engine.servers[1].apply

    def apply_then_flip(version: int, timeout: float = 60.0) -> dict[str, Any]:
        out = real_apply(version, timeout)
        w = engine.models[1].get_parameter("model.layers.0.self_attn.o_proj.weight")
        w.data.view(torch.int16)[0, 0] ^= 1  # one bit of rank 1's shard
        return out

    engine.servers[1].apply = apply_then_flip  # type: ignore[method-assign]
    with pytest.raises(Exception, match="could not reach"):
        sync.sync_to()
    assert not sync.healthy and "rank 1: model.layers.0.self_attn.o_proj.weight" in sync.reason
    with pytest.raises(Exception, match="refusing"):
        sync.generate([[1]], SamplingParams(max_new_tokens=1))
    engine.servers[1].apply = real_apply  # type: ignore[method-assign]
    trainer.step(anchor=True)
    assert sync.sync_to().version == 2 and sync.healthy  # an anchor repairs every shard


def test_shard_requests_report_rank_errors(sharded: Any) -> None:
    engine, cfg = sharded
    shards = engine.shards
    stranger = st_save({"x": torch.zeros(2)})
    with pytest.raises(RuntimeError, match=r"rank 0: .*anchor's tensors are not this rank's"):
        shards._ask([{"op": "anchor", "version": 1}] * 2, [stranger, stranger])
    with pytest.raises(RuntimeError, match="unknown request"):
        shards._ask([{"op": "nope"}] * 2, [b"", b""])
    with pytest.raises(TimeoutError, match="never staged"):
        engine.servers[0].apply(42, timeout=0.01)
    with pytest.raises(StateMismatchError, match="held by no rank"):
        ShardedWeights(
            {"w": ("bfloat16", (4, 2))},
            [{"w": Box((4, 2), (0, 0), (2, 2))}],
            [shards._conns[0]],
            lambda *a: [],
        )
    state = clone_state(full_state(cfg))
    shards.stage_anchor(state, 7)  # the ranks stay usable after errors
    assert [s.apply(7)["apply"] for s in engine.servers] == ["copy", "copy"]
    assert shards.mismatches(list(state), state) == []
