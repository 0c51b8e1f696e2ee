"""Routing replay on a tiny Qwen3-MoE: the transformers engine records the experts each position
was routed to while it generates (prefill and every decode step, left padding included), the
trainer's forward routes through them, and that is what closes the logprob gap a router's
numerics open; the coordinator's limits refuse a record the trainer could not replay."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from deltarl.rollout.engines.base import SamplingParams
from deltarl.rollout.engines.transformers_engine import TransformersEngine
from deltarl.services.common.moe_routing import (
    RoutingRecorder,
    UnsupportedRoutingError,
    replay_routing,
    routers,
)
from deltarl.services.coordinator.schemas import (
    RoutedExperts,
    RoutingShape,
    Trajectory,
    TrajectoryGroup,
    check_model_limits,
)
from deltarl.services.coordinator.schemas.trajectories import OutsideLimitsError
from deltarl.trainer.learn.batch import collate
from deltarl.trainer.learn.loss import token_logprobs
from deltarl.trainer.learn.step import forward_logits
from deltarl.trainer.screen import model_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from moe_helpers import deepseek_v3_config, hf_moe_model, qwen3_moe_config

LAYERS, EXPERTS, TOP_K = 2, 8, 2
PROMPTS = [[5, 9, 14, 3, 22, 7, 31], [8, 2, 40]]


def model() -> torch.nn.Module:
    cfg = qwen3_moe_config(layers=LAYERS, experts=EXPERTS, top_k=TOP_K)
    return hf_moe_model(cfg, seed=1, dtype=torch.float32).eval()


def generated(m: torch.nn.Module, starts: list[int]) -> list:
    engine = TransformersEngine(copy.deepcopy(m), seed=0)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    return engine.generate(PROMPTS, params, routing_from=starts)


def trajectories(m: torch.nn.Module) -> tuple[TrajectoryGroup, list]:
    outs = generated(m, [0, 0])
    trajs = []
    for p, c in zip(PROMPTS, outs, strict=True):
        n = len(p) + len(c.token_ids)
        trajs.append(
            Trajectory(
                tokens=[*p, *c.token_ids],
                logprobs=[0.0] * len(p) + c.logprobs,
                mask=[0] * len(p) + [1] * len(c.token_ids),
                prompt_len=len(p),
                reward=1.0,
                version_min=0,
                version_max=0,
                routed_experts=RoutedExperts.of(c.routed_experts),
            )
        )
        assert c.routed_experts.shape == (n - 1, LAYERS, TOP_K)
    group = TrajectoryGroup(
        idempotency_key="k" * 16, worker_id="w1", group_id="g1", trajectories=trajs
    )
    return group, outs


def test_the_engine_records_what_a_full_forward_routes() -> None:
    m = model()
    outs = generated(m, [0, 2])
    for p, c, start in zip(PROMPTS, outs, [0, 2], strict=True):
        seq = torch.tensor([[*p, *c.token_ids]])
        with torch.no_grad(), RoutingRecorder(m) as rec:
            m(input_ids=seq)
        full = rec.calls[0].numpy()  # [n, layers, top_k]
        got = c.routed_experts
        assert got.shape == (len(p) + len(c.token_ids) - 1 - start, LAYERS, TOP_K)
        # the same experts per position (their order within top_k is the router's ranking)
        assert np.array_equal(np.sort(got, -1), np.sort(full[start:-1], -1))


def test_replay_closes_the_gap_of_a_router_that_flips() -> None:
    engine_model = model()
    group, _ = trajectories(engine_model)
    batch = collate([group])  # right-padded: the record must follow the [B, T] layout
    trainer = copy.deepcopy(engine_model)
    with torch.no_grad():  # the trainer's router computes a little differently
        g = torch.Generator().manual_seed(5)
        for r in routers(trainer):
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * 0.05)

    def logprobs(routing: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        with torch.no_grad(), replay_routing(trainer, routing), RoutingRecorder(trainer) as rec:
            logits = forward_logits(trainer, batch.tokens, batch.attention_mask)
        lp = token_logprobs(logits, batch.tokens)
        used = rec.calls[0].view(*batch.tokens.shape, LAYERS, TOP_K)
        recorded = batch.routing
        valid = recorded[..., 0, 0] >= 0
        flips = int((used.sort(-1).values != recorded.sort(-1).values)[valid].any(-1).any(-1).sum())
        return lp, flips

    behaviour = batch.behaviour_logprobs
    mask = batch.loss_mask

    own, own_flips = logprobs(None)
    replayed, replayed_flips = logprobs(batch.routing)
    assert own_flips > 0, "the perturbation should flip some routes"
    assert replayed_flips == 0
    gap_own = (own - behaviour)[mask].abs().mean()
    gap_replayed = (replayed - behaviour)[mask].abs().mean()
    assert gap_replayed < gap_own
    # with the engine's own router, replay reproduces the engine's logprobs
    with torch.no_grad(), replay_routing(engine_model, batch.routing):
        exact = token_logprobs(
            forward_logits(engine_model, batch.tokens, batch.attention_mask), batch.tokens
        )
    assert torch.allclose(exact[mask], behaviour[mask], atol=1e-4)


def test_the_router_still_learns_under_replay() -> None:
    m = model()
    group, _ = trajectories(m)
    batch = collate([group])
    with replay_routing(m, batch.routing):
        logits = forward_logits(m, batch.tokens, batch.attention_mask)
    token_logprobs(logits, batch.tokens)[batch.loss_mask].sum().backward()
    for r in routers(m):
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    # the routers are themselves again after the block
    assert all("forward" not in vars(r) for r in routers(m))


def test_a_record_of_the_wrong_shape_is_refused() -> None:
    m = model()
    wrong_layers = torch.zeros((1, 4, LAYERS + 1, TOP_K), dtype=torch.int64)
    with pytest.raises(ValueError, match="MoE layers"), replay_routing(m, wrong_layers):
        pass
    four_tokens = torch.zeros((1, 4, LAYERS, TOP_K), dtype=torch.int64)
    with pytest.raises(ValueError, match="expert ids"), replay_routing(m, four_tokens):
        m(input_ids=torch.zeros((1, 5), dtype=torch.int64))


def test_limits_name_what_a_record_must_fit() -> None:
    m = model()
    limits = model_limits(m)
    assert limits is not None
    assert limits.routing == RoutingShape(layers=LAYERS, top_k=TOP_K, experts=EXPERTS)
    group, _ = trajectories(m)
    check_model_limits(group, limits)

    def with_record(ids: np.ndarray) -> TrajectoryGroup:
        t = group.trajectories[0].model_copy(update={"routed_experts": RoutedExperts.of(ids)})
        return group.model_copy(update={"trajectories": [t]})

    rows = len(group.trajectories[0].tokens) - 1
    good = np.tile(np.array([0, 1], np.uint16), (rows, LAYERS, 1))
    check_model_limits(with_record(good), limits)
    cases = {
        "outside the model's 8 experts": good + 7,
        "an expert twice": np.zeros_like(good),
        "1 layers": good[:, :1],
    }
    for message, ids in cases.items():
        with pytest.raises(OutsideLimitsError, match=message):
            check_model_limits(with_record(ids), limits)
    dense = limits.model_copy(update={"routing": None})
    with pytest.raises(OutsideLimitsError, match="no routing"):
        check_model_limits(group, dense)


def test_a_record_that_does_not_cover_the_tokens_is_refused() -> None:
    ids = RoutedExperts.of(np.zeros((2, LAYERS, TOP_K), np.uint16))
    with pytest.raises(ValueError, match="want 3 rows"):
        Trajectory(
            tokens=[1, 2, 3, 4],
            logprobs=[0.0, -1.0, -1.0, -1.0],
            mask=[0, 1, 1, 1],
            prompt_len=1,
            reward=0.0,
            version_min=0,
            version_max=0,
            routed_experts=ids,
        )


def test_routers_replay_does_not_know_are_named() -> None:
    m = hf_moe_model(deepseek_v3_config(), dtype=torch.float32)
    with pytest.raises(UnsupportedRoutingError, match="DeepseekV3TopkRouter"):
        routers(m)
    limits = model_limits(m)
    assert limits is not None and limits.routing is None


def test_train_step_replays_with_the_setting(tmp_path: Path) -> None:
    """The setting reaches the forward: the step's on-policy mismatch with a router that flips
    falls with replay; without the setting the record is ignored."""
    from test_distributed import make_settings

    from deltarl.trainer.learn.optim import build_optimizer
    from deltarl.trainer.learn.step import train_step

    engine_model = model()
    group, _ = trajectories(engine_model)
    batch = collate([group], 0)

    def mismatch(replay: bool) -> float:
        trainer = copy.deepcopy(engine_model)
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for r in routers(trainer):
                r.weight.add_(torch.randn(r.weight.shape, generator=g) * 0.05)
        base = make_settings(tmp_path / f"run-{replay}")
        settings = base.model_copy(
            update={
                "sampling": base.sampling.model_copy(
                    update={"max_onpolicy_mismatch_kl": None, "routing_replay": replay}
                )
            }
        )
        opt, sched = build_optimizer(trainer.parameters(), settings.optimizer, settings.max_steps)
        metrics = train_step(trainer, opt, sched, batch, settings)
        assert ("routing/replayed_trajectories" in metrics) == replay
        return metrics["mismatch/abs_logprob_diff/mean"]

    assert mismatch(True) < mismatch(False)


def test_the_recorder_ignores_forwards_of_other_threads() -> None:
    """The engine may score a hint on another thread while it generates: that forward's routes
    are not the generation's."""
    import threading

    m = model()
    ids = torch.tensor([[5, 9, 14]])
    with torch.no_grad(), RoutingRecorder(m) as rec:
        other = threading.Thread(target=lambda: m(input_ids=torch.tensor([[1, 2, 3, 4, 5]])))
        other.start()
        other.join()
        m(input_ids=ids)
    assert len(rec.calls) == 1 and rec.calls[0].shape == (3, LAYERS, TOP_K)
