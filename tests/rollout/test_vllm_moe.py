"""Mixture-of-experts models through the vllm engine's mapping, on CPU (docs/vllm.md, "Mixture
of experts").

The trainer publishes what transformers 5 holds: stacked expert tensors
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``, the
router ``mlp.gate.weight``. vLLM 0.33 holds them stacked the same way
(``mlp.experts.routed_experts.w13_weight`` / ``w2_weight``) but its loader writes them expert by
expert, gate and up apart (``moe_helpers.VllmMoeRank`` plays one rank with that loader). The
probe must turn those many writes into one contiguous view per tensor (TP=1), or one box per
rank (tensor parallelism: each expert's gate and up rows narrowed, one box of ``[E, 2, I, H]``;
expert parallelism: whole experts), a delta must land through those views in one staged apply
(one store-kernel address list for every expert of every layer), bit-exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from moe_helpers import (
    VllmMoeRank,
    bits_equal,
    deepseek_v3_config,
    moe_state,
    perturb_experts,
    qwen3_moe_config,
    rank_models,
    snapshot,
)
from rollout_helpers import FakeTrainer

from deltarl.rollout.engines.base import Completion, Engine, SamplingParams, WeightsGate
from deltarl.rollout.engines.vllm_mapping import (
    MappingError,
    probe_shards,
    probe_views,
    specs_of,
    uncovered,
)
from deltarl.rollout.engines.vllm_shards import (
    ShardedWeights,
    ShardServer,
    connect,
    decode_delta,
    encode_delta,
    new_key,
    shard_delta,
)
from deltarl.rollout.engines.vllm_transfer import check_supported
from deltarl.rollout.sync.weights import WeightSync
from deltarl.weightsync.delta import (
    _stage_batched,
    _store_plan,
    apply_staged,
    compute_delta,
    stage_delta,
)
from deltarl.weightsync.reader import BucketReader

# distinct sizes (6 experts, 2I = 24, H = 32, I/4 = 3), so a confused dimension shows
QWEN = {"experts": 6, "moe_inter": 12, "hidden": 32}
LAYOUTS = [(1, False), (2, False), (4, False), (2, True), (4, True)]  # (ranks, expert parallel)


def qwen(**kw: Any) -> Any:
    return qwen3_moe_config(**{**QWEN, **kw})


def deepseek_like(cfg: Any) -> dict[str, Any]:
    """DeepSeek-V3 in a vLLM that would hold its router and the router's bias in the dtypes
    transformers publishes them in, and derive nothing after loading (vLLM 0.33 does neither:
    see the refusal test). Those dtypes depend on the transformers version (recent ones keep the
    router in fp32 in a bf16 model, older ones do not), so they are read off the published
    state."""
    dtypes = {
        s.name.rsplit(".", 1)[-1]: s.dtype
        for s in specs_of(moe_state(cfg))
        if ".mlp.gate." in s.name
    }
    return {
        "router_dtype": getattr(torch, dtypes["weight"]),
        "bias_dtype": getattr(torch, dtypes["e_score_correction_bias"]),
        "derived": False,
    }


def stacked(name: str) -> bool:
    return name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


# ------------------------------------------------------------------ TP = 1: one view per tensor


def test_each_stacked_expert_tensor_is_one_view_of_vllms_stacked_parameter() -> None:
    cfg = qwen()
    state = moe_state(cfg)
    model = VllmMoeRank(cfg)
    before = snapshot(model)
    views = probe_views(model, specs_of(state))
    assert bits_equal(snapshot(model), before)  # probing wrote nothing
    assert list(views) == list(state) and uncovered(model, views) == []
    for i in range(cfg.num_hidden_layers):
        moe = f"model.layers.{i}.mlp.experts.routed_experts"
        for hf, vllm in (("gate_up_proj", "w13_weight"), ("down_proj", "w2_weight")):
            view = views[f"model.layers.{i}.mlp.experts.{hf}"]
            param = model.get_parameter(f"{moe}.{vllm}")
            # the whole stacked parameter, in place: [E, 2I, H] and [E, H, I] need no transpose
            assert view.data_ptr() == param.data_ptr() and view.shape == param.shape
            assert view.is_contiguous()
        router = views[f"model.layers.{i}.mlp.gate.weight"]
        assert (
            router.data_ptr() == model.get_parameter(f"model.layers.{i}.mlp.gate.weight").data_ptr()
        )
    model.load_weights(state.items())  # what vLLM's loader makes of the trainer's tensors
    assert bits_equal({n: v.clone() for n, v in views.items()}, state)


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint naming of transformers < 5 (and of saved Qwen3-MoE checkpoints): one
    ``gate_proj``/``up_proj``/``down_proj`` per expert."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name.removesuffix("gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = gate[e].clone()
                out[f"{pre}{e}.up_proj.weight"] = up[e].clone()
        elif name.endswith("mlp.experts.down_proj"):
            pre = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def test_per_expert_checkpoint_names_map_to_blocks_of_the_stacked_parameter() -> None:
    cfg = qwen()
    state = per_expert(moe_state(cfg))
    model = VllmMoeRank(cfg)
    views = probe_views(model, specs_of(state))
    w13 = model.get_parameter("model.layers.1.mlp.experts.routed_experts.w13_weight")
    e, i = 4, cfg.moe_intermediate_size
    up = views[f"model.layers.1.mlp.experts.{e}.up_proj.weight"]
    assert up.data_ptr() == w13[e, i:].data_ptr() and up.shape == (i, cfg.hidden_size)
    model.load_weights(state.items())
    assert bits_equal({n: v.clone() for n, v in views.items()}, state)


# ------------------------------------------------------------------ TP / EP: one box per rank


@pytest.mark.parametrize(("ranks", "ep"), LAYOUTS[1:])
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_every_ranks_box_is_what_its_loader_writes(ranks: int, ep: bool, kind: str) -> None:
    cfg = qwen() if kind == "qwen3_moe" else deepseek_v3_config()
    extra = {} if kind == "qwen3_moe" else deepseek_like(cfg)
    state = moe_state(cfg)
    specs = specs_of(state)
    all_boxes = []
    for model in rank_models(cfg, ranks, ep=ep, **extra):
        before = snapshot(model)
        views, boxes = probe_shards(model, specs)
        assert bits_equal(snapshot(model), before)
        model.load_weights(state.items())  # the loader's real writes
        for name, view in views.items():
            assert view.is_contiguous()
            want = boxes[name].take(state[name])
            assert torch.equal(view.view(torch.uint8), want.view(torch.uint8)), name
        up = boxes["model.layers.1.mlp.experts.gate_up_proj"]
        down = boxes["model.layers.1.mlp.experts.down_proj"]
        e, inter, h = model.experts, cfg.moe_intermediate_size, cfg.hidden_size
        if ep:  # whole experts of this rank
            k, first = model.local_experts, model.first_expert
            assert up.shape == (e, 2 * inter, h) and up.start == (first, 0, 0)
            assert up.size == (k, 2 * inter, h) and down.size == (k, h, inter)
        else:  # every expert, this rank's rows of gate and of up: one box of [E, 2, I, H]
            i, r = inter // ranks, model.rank
            assert up.shape == (e, 2, inter, h)
            assert up.start == (0, 0, r * i, 0) and up.size == (e, 2, i, h)
            assert down.start == (0, 0, r * i) and down.size == (e, h, i)
        all_boxes.append(boxes)
    # together the ranks hold every element (else part of a tensor would never follow)
    ShardedWeights({s.name: (s.dtype, s.shape) for s in specs}, all_boxes, [None] * ranks, list)  # type: ignore[list-item]
    with pytest.raises(MappingError, match="only part"):
        probe_shards(rank_models(cfg, ranks, ep=ep, **extra)[0], specs, shards=False)


@pytest.mark.parametrize(("ranks", "ep"), LAYOUTS[1:])
def test_sliced_expert_deltas_leave_every_rank_as_if_loaded_with_the_new_state(
    ranks: int, ep: bool
) -> None:
    cfg = qwen()
    old = moe_state(cfg, seed=1)
    new = perturb_experts(old, seed=5, density=0.05)
    delta = compute_delta(old, new, base_version=0, version=1)
    expected = rank_models(cfg, ranks, ep=ep, seed=9)
    for model in expected:
        model.load_weights(new.items())
    specs = specs_of(old)
    for model, want in zip(rank_models(cfg, ranks, ep=ep), expected, strict=True):
        views, boxes = probe_shards(model, specs)
        model.load_weights(old.items())
        local = shard_delta(delta, boxes)
        local = decode_delta(encode_delta(local), local.base_version, local.version)
        staged = stage_delta(local, "cpu", views)
        apply_staged(views, staged)
        got, exp = snapshot(model), snapshot(want)
        for name in got:  # padding rows: zero in both (the loader's fill_)
            assert torch.equal(got[name].view(torch.int16), exp[name].view(torch.int16)), name


# ------------------------------------------------------------------ one staged apply


def emulate_store(model: torch.nn.Module, stores: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """What the store kernel does on a GPU (``*addr = value``), on CPU: every address must fall
    inside one runtime parameter; returns the elements written."""
    params = [p for _, p in model.named_parameters()]
    written = 0
    for addr, val in stores:
        hit = torch.zeros(addr.shape, dtype=torch.bool)
        for p in params:
            es, base = p.element_size(), p.data_ptr()
            inside = (addr >= base) & (addr < base + p.numel() * es)
            if val.element_size() != es or not bool(inside.any()):
                continue
            flat = p.data.view(-1).view(val.dtype)
            flat[(addr[inside] - base) // es] = val[inside]
            hit |= inside
        assert bool(hit.all()), "an address outside every parameter"
        written += int(addr.numel())
    return written


def test_a_delta_of_every_expert_is_one_staged_apply() -> None:
    cfg = qwen(layers=3)
    old = moe_state(cfg, seed=1)
    new = perturb_experts(old, seed=2, density=0.02, routed=cfg.num_experts)  # every expert
    delta = compute_delta(old, new, 0, 1)
    model = VllmMoeRank(cfg)
    views = probe_views(model, specs_of(old))
    model.load_weights(old.items())
    staged = stage_delta(delta, "cpu", views)
    # one part per changed checkpoint tensor: two per MoE layer for all its experts, where a
    # per-expert mapping has 3 x E (the ~18k tensors of Qwen3-30B-A3B)
    expert_parts = [n for n, _, _ in staged.parts if stacked(n)]
    assert len(expert_parts) == 2 * cfg.num_hidden_layers
    assert len(staged.parts) == sum(1 for p in delta.patches.values() if p.changed)
    # the GPU path: one address list per bit width (bf16: one) for every expert of every layer,
    # which the store kernel writes in one launch
    patches = [p for p in delta.patches.values() if p.changed]
    parts, groups = _stage_batched(patches, torch.device("cpu"), pin=False)
    staged.parts = parts
    from deltarl.weightsync.delta import _targets

    stores = _store_plan(groups, _targets(views, staged))
    assert len(stores) == 1 and int(stores[0][0].numel()) == delta.changed
    assert emulate_store(model, stores) == delta.changed
    assert bits_equal({n: v.clone() for n, v in views.items()}, new)


# ------------------------------------------------------------------ following a bucket


class ViewsEngine(Engine):
    """An engine whose weights are a vLLM-shaped model's views (TP = 1), or ``ranks`` ranks'
    shards behind :class:`ShardServer` threads (TP or EP > 1), as the vllm engine has them."""

    type = "vllm"

    def __init__(self, models: list[Any], specs: Any, tmp: Path) -> None:
        self.models = models
        self.calls: list[str] = []
        self.shards: ShardedWeights | None = None
        self.servers: list[ShardServer] = []
        if len(models) == 1:
            self.views = probe_views(models[0], specs)
            return
        key, boxes = new_key(), []
        for r, model in enumerate(models):
            views, b = probe_shards(model, specs)
            self.servers.append(ShardServer(views, torch.device("cpu"), f"{tmp}/rank.{r}", key))
            boxes.append(b)
        conns = connect([f"{tmp}/rank.{r}" for r in range(len(models))], key)

        def rpc(method: str, *args: Any) -> list[Any]:
            self.calls.append(method)
            return [s.apply(*args) for s in self.servers]

        self.shards = ShardedWeights({s.name: (s.dtype, s.shape) for s in specs}, boxes, conns, rpc)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def named_parameters(self) -> Mapping[str, torch.Tensor]:
        if self.shards is not None:
            raise RuntimeError("sharded")
        return self.views

    def sharded_weights(self) -> ShardedWeights | None:
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
        if self.shards is not None:
            self.shards.close()
        for s in self.servers:
            s.close()


@pytest.fixture
def engines() -> Iterator[list[ViewsEngine]]:
    made: list[ViewsEngine] = []
    yield made
    for e in made:
        e.close()


@pytest.mark.parametrize(("ranks", "ep"), [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_weight_sync_follows_moe_versions_into_vllms_experts(
    ranks: int, ep: bool, kind: str, bucket: Any, tmp_path: Path, engines: list[ViewsEngine]
) -> None:
    cfg = qwen() if kind == "qwen3_moe" else deepseek_v3_config()
    extra = {} if kind == "qwen3_moe" else deepseek_like(cfg)
    states = [moe_state(cfg, seed=3)]
    trainer = FakeTrainer(bucket, states[0])
    engine = ViewsEngine(rank_models(cfg, ranks, ep=ep, **extra), specs_of(states[0]), tmp_path)
    engines.append(engine)
    sync = WeightSync(engine, BucketReader(bucket), host_mirror=True)
    sync.sync_to()
    for v in (1, 2, 3):
        states.append(perturb_experts(states[-1], seed=10 + v))
        trainer.publish(v, states[-1], base=v - 1)
    report = sync.sync_to()
    assert report.version == 3 and [s.kind for s in report.steps] == ["delta"] * 3
    if ranks > 1:
        assert engine.calls == ["deltarl_tp_apply"] * 4  # anchor + 3 deltas: one window each
    for model in engine.models:  # every rank as if vLLM had loaded the trainer's state
        want = VllmMoeRank(cfg, ranks, model.rank, ep=ep, seed=99, **extra)
        want.load_weights(states[3].items())
        got, exp = snapshot(model), snapshot(want)
        rows = model.vocab_rows[1]
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            exp[name][rows:] = got[name][rows:]  # padding rows: never written
        assert bits_equal(got, exp)
    out = sync.generate([[1]], SamplingParams(max_new_tokens=1))
    assert out[0].version_max == 3 and sync.check(out[0]) == "verified"


# ------------------------------------------------------------------ refused, with the reason


def test_what_vllm_033_cannot_follow_in_place_is_refused_with_the_reason() -> None:
    cfg = deepseek_v3_config()
    specs = specs_of(moe_state(cfg))
    # MLA: vLLM derives W_UK_T / W_UV from kv_b_proj after loading
    with pytest.raises(MappingError, match=r"W_UK_T .*computed from a checkpoint tensor"):
        probe_views(VllmMoeRank(cfg), specs)
    # the router: vLLM 0.33 holds it in bf16 and its bias in fp32, whatever transformers keeps
    # (recent versions: both fp32; older ones: both bf16), so one of them does not match
    with pytest.raises(
        MappingError, match=r"mlp\.gate\.(weight|e_score_correction_bias): the runtime tensor is"
    ):
        probe_views(VllmMoeRank(cfg, derived=False), specs)
    # a fused checkpoint stored transposed ([E, H, 2I]; vLLM transposes it while loading)
    q = qwen()
    transposed = {
        n: t.transpose(-1, -2).contiguous() if stacked(n) else t for n, t in moe_state(q).items()
    }
    with pytest.raises(MappingError, match=r"gate_up_proj: .*transformed part.*transposed"):
        probe_views(VllmMoeRank(q, transposed=True), specs_of(transposed))
    # a MoE kernel backend that re-lays the experts after loading (FlashInfer on Blackwell)
    with pytest.raises(MappingError, match=r"FlashInfer CUTLASS MoE backend re-lays the experts"):
        probe_views(VllmMoeRank(q, moe_backend="FlashInfer CUTLASS"), specs_of(moe_state(q)))
    # experts replicated by the load balancer: no fixed place to patch
    par = SimpleNamespace(pipeline_parallel_size=1, enable_eplb=True)
    with pytest.raises(ValueError, match=r"enable_eplb"):
        check_supported(SimpleNamespace(parallel_config=par, model_config=SimpleNamespace()))
    par.enable_eplb = False
    check_supported(SimpleNamespace(parallel_config=par, model_config=SimpleNamespace()))


def test_a_replicated_expert_is_refused() -> None:
    """A loader that writes one checkpoint expert into two slots (what redundant experts do)."""
    cfg = qwen()
    model = VllmMoeRank(cfg)
    real = model._weight_loader

    def twice(param: Any, loaded: torch.Tensor, shard_id: str, expert: int) -> None:
        real(param, loaded, shard_id, expert)
        if expert == 0:
            real(param, loaded, shard_id, 1)

    model._weight_loader = twice  # type: ignore[method-assign]
    with pytest.raises(MappingError, match=r"overlap or leave gaps|not the C order"):
        probe_views(model, specs_of(moe_state(cfg)))


def test_boxes_of_a_refined_shape_slice_flat_indices() -> None:
    from deltarl.rollout.engines.vllm_shards import Box

    box = Box((6, 2, 12, 32), (0, 0, 3, 0), (6, 2, 3, 32))
    assert box.fits((6, 24, 32)) and not box.fits((6, 32, 24)) and not box.fits((24, 6, 32))
    full = torch.arange(6 * 24 * 32).reshape(6, 24, 32)
    taken = box.take(full)
    assert taken.shape == (6, 2, 3, 32)
    assert torch.equal(taken[2, 1, 0], full[2, 12 + 3])  # expert 2, up row 3
    index = np.sort(np.random.default_rng(0).choice(full.numel(), 500, replace=False))
    which, local = box.localize(index)
    assert torch.equal(taken.reshape(-1)[torch.from_numpy(local)], full.reshape(-1)[index[which]])
