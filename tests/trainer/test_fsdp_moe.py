"""FSDP2 on mixture-of-experts models (CPU, gloo, 2 ranks): tiny random Qwen3-MoE and
DeepSeek-V3 (shared experts, a router transformers keeps in fp32).

transformers 5 holds a layer's routed experts as two stacked parameters (``[E, 2I, H]``,
``[E, H, I]``), so FSDP2's row sharding (``Shard(0)``) gives each rank whole experts: rank 0
experts 0-1, rank 1 experts 2-3. Checked: the ranks train as one process does (bit for bit),
every rank publishes its experts' rows as a part of each version (the router in fp32 where the
model keeps it so), a transformers engine follows the sharded versions bit-exactly, and a
sharded checkpoint resumes bit-exactly."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import spawn_ranks
from test_distributed import make_settings
from test_fsdp import join
from test_step import varied_groups

from deltarl.buckets.local import LocalBucket
from deltarl.trainer.checkpoint.sharded import ShardedCheckpointer
from deltarl.trainer.learn.batch import collate
from deltarl.trainer.learn.distributed import (
    DistContext,
    broadcast,
    shard_fsdp,
    shutdown_distributed,
)
from deltarl.trainer.learn.optim import build_optimizer
from deltarl.trainer.learn.step import train_step
from deltarl.trainer.publish.sharded import ShardedPublisher, local_rows
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.trainer.settings import ExperimentSettings
from deltarl.weightsync.codec.formats import describe
from deltarl.weightsync.model_state import publishable_state
from deltarl.weightsync.reader import BucketReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from moe_helpers import deepseek_v3_config, hf_moe_model, qwen3_moe_config

KINDS = ("qwen3_moe", "deepseek_v3")
POSITIONS = {"qwen3_moe": "contexts", "deepseek_v3": "gaps"}  # both ways of coding positions
STEPS = 3


def moe_config(kind: str) -> Any:
    return qwen3_moe_config(vocab=64) if kind == "qwen3_moe" else deepseek_v3_config(vocab=64)


def settings_of(root: Path) -> ExperimentSettings:
    base = make_settings(root / "run")  # 2 groups of 8: 1 process 2 micro-batches, 2 ranks 1 each
    return base.model_copy(
        update={
            "optimizer": base.optimizer.model_copy(update={"lr": 1e-3, "warmup_steps": 0}),
            "sampling": base.sampling.model_copy(update={"max_onpolicy_mismatch_kl": None}),
            "publish": base.publish.model_copy(update={"positions": POSITIONS[root.name]}),
        }
    )


def batches() -> list[Any]:
    """Equal-length trajectories (no padding differs between a micro-batch and a rank's rows)."""
    return [collate(varied_groups([[12] * 8, [12] * 8], seed=s), 0) for s in range(STEPS)]


def fp32_model(kind: str) -> torch.nn.Module:
    return hf_moe_model(moe_config(kind), seed=0, dtype=torch.float32)


def publish(pub: ShardedPublisher, model: torch.nn.Module, ctx: DistContext, step: int) -> None:
    """One version by every rank, as the loop (rank 0) and ``train_replica`` do it."""
    if ctx.is_main:
        pub.publish(local_rows(model, ctx), step=step, anchor=step == 0)
    else:
        kind, payload = broadcast(None, ctx)
        assert kind == "publish", kind
        pub.publish_local(local_rows(model, ctx), *payload)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (a collective), or a replicated buffer as it is."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def rank_main(rank: int, root: str) -> None:
    ctx, device = join(rank, root)
    for kind in KINDS:
        out = Path(root) / kind
        settings = settings_of(out)
        model = shard_fsdp(fp32_model(kind), ctx, device)
        experts = model.model.layers[1].mlp.experts.gate_up_proj
        assert experts.to_local().shape[0] == experts.shape[0] // 2  # whole experts per rank
        opt, sched = build_optimizer(model.parameters(), settings.optimizer, settings.max_steps)
        pub = ShardedPublisher(
            LocalBucket(out / "bucket"), settings.publish, ctx, scan_on_device=rank == 1
        )
        keep = pub.follow_precision(model)
        ckpt = ShardedCheckpointer(out / "ckpt", ctx)
        publish(pub, model, ctx, 0)
        for step, batch in enumerate(batches(), start=1):
            train_step(model, opt, sched, batch, settings, dist=ctx)
            publish(pub, model, ctx, step)
            if step == STEPS - 1:
                if ctx.is_main:
                    ckpt.save(step, model, opt, sched, version=step)
                else:
                    assert broadcast(None, ctx) == ("checkpoint", step)
                    ckpt.save_local(step, model, opt, sched)
        pub.close()
        final = {k: whole(v) for k, v in publishable_state(model).items()}  # the test only
        mine = {k: local(v) for k, v in model.state_dict().items()}

        # resume: a fresh sharded model from the step-2 checkpoint takes the same last step
        resumed = shard_fsdp(fp32_model(kind), ctx, device)
        opt2, sched2 = build_optimizer(resumed.parameters(), settings.optimizer, settings.max_steps)
        ckpt.load().restore(resumed, opt2, sched2)  # type: ignore[arg-type]
        train_step(resumed, opt2, sched2, batches()[-1], settings, dist=ctx)
        again = {k: local(v) for k, v in resumed.state_dict().items()}
        assert all(torch.equal(again[k], mine[k]) for k in mine), (rank, kind)
        if ctx.is_main:
            torch.save(final, out / "final.pt")
            (out / "keep.json").write_text(json.dumps(sorted(keep)))
    shutdown_distributed(ctx)


def one_process(kind: str, root: Path) -> dict[str, torch.Tensor]:
    """The same steps in one process (2 micro-batches), published by a WeightPublisher."""
    settings = settings_of(root)
    model = fp32_model(kind)
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, settings.max_steps)
    with WeightPublisher(LocalBucket(root / "bucket1")) as pub:
        pub.follow_precision(model)
        pub.publish(publishable_state(model), anchor=True)
        for batch in batches():
            train_step(model, opt, sched, batch, settings)
            pub.publish(publishable_state(model))
    return {k: v.detach().clone() for k, v in publishable_state(model).items()}


@pytest.mark.slow
def test_fsdp_shards_experts_publishes_them_and_resumes_like_one_process(
    tmp_path: Path, one_thread: None
) -> None:
    from deltarl.rollout.engines.transformers_engine import TransformersEngine
    from deltarl.rollout.sync.weights import WeightSync

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn_ranks(rank_main, tmp_path, 2)
    for kind in KINDS:
        out = tmp_path / kind
        final = torch.load(out / "final.pt")
        single = one_process(kind, out)
        assert set(final) == set(single)
        for name in single:  # FSDP2's reduce-scatter of two micro-batch gradients: one addition
            torch.testing.assert_close(final[name], single[name], rtol=0, atol=0, msg=name)

        keep = set(json.loads((out / "keep.json").read_text()))
        assert bool(keep) == (kind == "deepseek_v3")  # the router (and its bias) in fp32
        reader = BucketReader(LocalBucket(out / "bucket"))
        last = reader.manifest(STEPS)
        layout = last.layout or ()
        e = moe_config(kind).num_local_experts
        for stacked in ("gate_up_proj", "down_proj"):
            name = f"model.layers.1.mlp.experts.{stacked}"
            assert f"{name}[0:{e // 2}]" in layout and f"{name}[{e // 2}:{e}]" in layout
        for o in last.objects:
            assert o.parts is not None and len(o.parts) == 2
        delta = next(o for o in last.objects if o.kind == "delta")
        for _, blob in reader.fetch_parts(delta):
            counts = describe(blob)["positions"]
            assert counts[POSITIONS[kind]] == sum(counts.values()) > 0, (kind, counts)

        # a transformers engine (bf16, router fp32 where transformers keeps it) follows
        engine = TransformersEngine(hf_moe_model(moe_config(kind), seed=5))
        sync = WeightSync(engine, BucketReader(LocalBucket(out / "bucket")))
        sync.sync_to(1)
        report = sync.sync_to(STEPS)
        assert [s.kind for s in report.steps] == ["delta"] * (STEPS - 1)
        got = engine.named_parameters()
        for name, t in final.items():
            want = t.to(torch.float32 if name in keep else torch.bfloat16)
            assert got[name].dtype == want.dtype, name
            assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name
        assert sync.verified_digest() == (STEPS, last.state_digest)
