"""A tiny policy learns a task through the trainer's own path: groups on the wire schema ->
staleness filter -> collate -> micro-batched GRPO step -> published versions, rebuilt exactly."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_weight_publisher import assert_bit_identical, rebuild

from deltarl.buckets.local import LocalBucket
from deltarl.services.coordinator.schemas import Trajectory, TrajectoryGroup
from deltarl.trainer.learn import step as step_module
from deltarl.trainer.learn.batch import TrainBatch, collate, filler, filter_stale, micro_batches
from deltarl.trainer.learn.distributed import DistContext, MicroBatch, rank_micro_batches
from deltarl.trainer.learn.loss import token_entropy, token_logprobs
from deltarl.trainer.learn.optim import build_optimizer
from deltarl.trainer.learn.step import forward_logits, frozen_reference, train_step
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.trainer.settings import ExperimentSettings
from deltarl.weightsync.reader import BucketReader

VOCAB, TARGET, COMPLETION = 8, 5, 3


class Bigram(torch.nn.Module):
    """Next-token logits from the previous token only."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(VOCAB, VOCAB)
        torch.nn.init.zeros_(self.table.weight)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.table(input_ids)


@torch.no_grad()
def rollout(
    model: Bigram,
    gen: torch.Generator,
    groups: int,
    size: int,
    version: int,
    temperature: float = 1.0,
    report_temperature: bool = False,
    turns: bool = False,
) -> list[TrajectoryGroup]:
    """Sample completions at ``temperature``; reward = share of completion tokens equal to
    TARGET. ``report_temperature``: the trajectories carry it, as deltarl workers send it.
    ``turns``: each completion token is a turn of its own, rewarded 1 / COMPLETION for a hit
    (the per-turn rewards travel as workers send them)."""
    out = []
    for g in range(groups):
        trajs = []
        prompt = int(torch.randint(0, VOCAB, (1,), generator=gen))
        for _ in range(size):
            tokens, logprobs = [prompt], [0.0]
            for _ in range(COMPLETION):
                logp = torch.log_softmax(model.table.weight[tokens[-1]] / temperature, -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                tokens.append(tok)
                logprobs.append(float(logp[tok]))
            hits = sum(t == TARGET for t in tokens[1:])
            trajs.append(
                Trajectory(
                    tokens=tokens,
                    logprobs=logprobs,
                    mask=[0] + [1] * COMPLETION,
                    prompt_len=1,
                    reward=hits / COMPLETION,
                    signals={"hits": float(hits)},
                    version_min=version,
                    version_max=version,
                    temperature=temperature if report_temperature else None,
                    turn_ends=list(range(2, COMPLETION + 2)) if turns else None,
                    turn_rewards=[(t == TARGET) / COMPLETION for t in tokens[1:]]
                    if turns
                    else None,
                )
            )
        out.append(
            TrajectoryGroup(
                idempotency_key=f"v{version}-g{g}",
                worker_id="w1",
                group_id=f"g{g}",
                trajectories=trajs,
            )
        )
    return out


def varied_groups(lengths: list[list[int]], seed: int = 0) -> list[TrajectoryGroup]:
    """One group per list of ``lengths``: trajectories of that many tokens (one prompt token,
    random ids and rewards), with the logprobs of an untrained :class:`Bigram` (uniform)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g, sizes in enumerate(lengths):
        trajs = [
            Trajectory(
                tokens=torch.randint(0, VOCAB, (n,), generator=gen).tolist(),
                logprobs=[0.0] + [-math.log(VOCAB)] * (n - 1),
                mask=[0] + [1] * (n - 1),
                prompt_len=1,
                reward=float(torch.rand((), generator=gen)),
                version_min=0,
                version_max=0,
            )
            for n in sizes
        ]
        groups.append(
            TrajectoryGroup(
                idempotency_key=f"k{g}", worker_id="w1", group_id=f"g{g}", trajectories=trajs
            )
        )
    return groups


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "credit"), [("fp32", "episode"), ("bf16", "episode"), ("fp32", "turn")]
)
def test_reward_goes_up_and_published_weights_match(
    tmp_path: Path, precision: str, credit: str
) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    settings = ExperimentSettings.load(
        None,
        [
            "max_steps=25",
            f"precision={precision}",
            "optimizer.lr=0.2",
            "batch.micro_batch_size=12",
            "batch.max_staleness=1",
            "loss.importance_sampling=token_truncate",
            f"loss.credit={credit}",
        ],
    )
    turns = credit == "turn"
    model = Bigram()
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, settings.max_steps)
    bucket = LocalBucket(tmp_path / "bucket")
    pub = WeightPublisher(bucket, settings.publish)
    pub.publish(model.state_dict(), step=0)
    rewards, stale_dropped = [], 0
    pending = rollout(model, gen, 4, 8, 0, turns=turns)
    for step in range(settings.max_steps):
        version = pub.last_version if pub.last_version is not None else 0
        # one step of lag, like an asynchronous worker: train on what the previous weights made
        fresh = rollout(model, gen, 4, 8, version, turns=turns)
        if step % 5 == 4:  # now and then a group arrives far too late: it must be dropped
            fresh[0] = rollout(model, gen, 1, 8, version - 3, turns=turns)[0]
        f = filter_stale(pending, version, settings.batch.max_staleness)
        stale_dropped += f.dropped_groups
        batch = collate(f.kept, version, credit=settings.loss.credit)
        assert batch.advantages.dim() == (2 if turns else 1)
        metrics = train_step(model, opt, sched, batch, settings)
        rewards.append(metrics["reward/mean"])
        assert metrics["step/skipped"] == 0.0 and metrics["tokens"] > 0
        assert "mismatch/kl" in metrics and "entropy" in metrics
        pub.publish(model.state_dict(), step=step + 1)
        pending = fresh
    pub.close()
    assert stale_dropped > 0
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.3 and last > 0.6, rewards
    # a replica rebuilt from the bucket holds exactly the trainer's bf16 weights
    want = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
    assert_bit_identical(rebuild(bucket)[0], want)
    assert BucketReader(bucket).latest_version() == settings.max_steps


class WrongShape(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return input_ids.float()


def test_kl_needs_a_reference_and_bad_models_are_refused() -> None:
    settings = ExperimentSettings.load(None, ["loss.kl_coef=0.1"])
    model = Bigram()
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, 10)
    batch = collate(rollout(model, torch.Generator().manual_seed(1), 1, 2, 0))
    with pytest.raises(ValueError, match="ref_model"):
        train_step(model, opt, sched, batch, settings)
    ref = Bigram()
    metrics = train_step(model, opt, sched, batch, settings, ref_model=ref)
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # same (zero) weights
    with pytest.raises(ValueError, match="logits"):
        forward_logits(WrongShape(), batch.tokens, batch.attention_mask)


def tiny_llama_config(vocab: int = VOCAB) -> Any:
    """A one-layer Llama over ``vocab`` token ids (transformers imported lazily)."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )


def test_a_hugging_face_model_trains_and_publishes(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    settings = ExperimentSettings.load(None, ["max_steps=3", "precision=bf16"])
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, settings.max_steps)
    batch = collate(rollout(Bigram(), torch.Generator().manual_seed(3), 2, 4, 0), 0)
    bucket = LocalBucket(tmp_path / "bucket")
    with WeightPublisher(bucket) as pub:
        pub.publish(model.state_dict())
        for step in range(settings.max_steps):
            metrics = train_step(model, opt, sched, batch, settings)
            assert metrics["step/skipped"] == 0.0 and metrics["step/grad_norm"] > 0
            pub.publish(model.state_dict(), step=step + 1)
    want = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
    assert_bit_identical(rebuild(bucket)[0], want)


@pytest.mark.parametrize("worker_t", [0.5, 2.0])
def test_the_ratio_uses_the_workers_temperature_and_mismatched_groups_are_dropped(
    worker_t: float,
) -> None:
    torch.manual_seed(0)
    model = Bigram()
    torch.nn.init.normal_(model.table.weight, std=2.0)
    groups = rollout(model, torch.Generator().manual_seed(2), 4, 8, 3, temperature=worker_t)
    batch = collate(groups, 3)  # sampled by version 3, trained as version 3: on-policy
    same = ExperimentSettings.load(None, [f"sampling.temperature={worker_t}", "precision=fp32"])
    opt, sched = build_optimizer(model.parameters(), same.optimizer, 10)
    before = model.table.weight.detach().clone()
    metrics = train_step(model, opt, sched, batch, same)
    assert metrics["mismatch/kl"] < 1e-6 and metrics["mismatch/kl_onpolicy"] < 1e-6
    assert metrics["is/weight/min"] == pytest.approx(1.0, abs=1e-5)
    assert not torch.equal(before, model.table.weight)
    # the trainer at T=1 would see ratios that measure the temperature, not the policy change
    wrong = ExperimentSettings.load(None, ["precision=fp32"])
    before = model.table.weight.detach().clone()
    dropped: dict[int, float] = {}
    metrics = train_step(model, opt, sched, collate(groups, 3), wrong, dropped=dropped)
    assert sorted(dropped) == [0, 1, 2, 3] and metrics["batch/rejected_mismatch"] == 4
    assert min(dropped.values()) > 0.03
    assert metrics["step/skipped"] == 1.0  # nothing left to train on: no update
    assert torch.equal(before, model.table.weight)
    # stale samples are not checked (their mismatch includes the policy change)
    metrics = train_step(model, opt, sched, collate(groups, 4), wrong)
    assert metrics["mismatch/kl"] > 0.1 and "mismatch/kl_onpolicy" not in metrics


def test_a_group_with_made_up_logprobs_is_dropped_and_the_rest_trains_as_without_it() -> None:
    """A worker claims the current version but sends logprobs the weights never gave: its group
    is dropped and the update is exactly that of the honest groups alone."""
    torch.manual_seed(0)
    model = Bigram()
    torch.nn.init.normal_(model.table.weight, std=2.0)
    honest = rollout(model, torch.Generator().manual_seed(2), 3, 8, 3)
    forged = rollout(model, torch.Generator().manual_seed(5), 1, 8, 3)[0]
    forged = forged.model_copy(
        update={
            "trajectories": [
                t.model_copy(update={"logprobs": [-20.0 if m else 0.0 for m in t.mask]})
                for t in forged.trajectories
            ]
        }
    )
    settings = ExperimentSettings.load(None, ["precision=fp32"])
    twin = Bigram()
    twin.load_state_dict(model.state_dict())
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, 10)
    opt2, sched2 = build_optimizer(twin.parameters(), settings.optimizer, 10)
    dropped: dict[int, float] = {}
    batch = collate([honest[0], forged, *honest[1:]], 3)
    metrics = train_step(model, opt, sched, batch, settings, dropped=dropped)
    assert list(dropped) == [1] and dropped[1] > 1.0 and metrics["batch/rejected_mismatch"] == 1
    assert metrics["batch/groups"] == 3 and metrics["step/skipped"] == 0.0
    alone = train_step(twin, opt2, sched2, collate(honest, 3), settings)
    assert torch.equal(model.table.weight, twin.table.weight)
    assert metrics["loss"] == pytest.approx(alone["loss"], abs=1e-7)


def test_a_reported_temperature_is_used_per_trajectory() -> None:
    """Trajectories that carry their sampling temperature are scored at it, whatever
    sampling.temperature says; a batch mixing temperatures is exact row by row."""
    torch.manual_seed(0)
    model = Bigram()
    torch.nn.init.normal_(model.table.weight, std=2.0)
    gen = torch.Generator().manual_seed(2)
    hot = rollout(model, gen, 2, 8, 3, temperature=2.0, report_temperature=True)
    cold = rollout(model, gen, 2, 8, 3, temperature=0.5, report_temperature=True)
    batch = collate(hot + cold, 3)
    assert batch.temperature is not None
    assert batch.temperatures(1.0).tolist() == [2.0] * 16 + [0.5] * 16
    settings = ExperimentSettings.load(None, ["precision=fp32"])  # T = 1 for unreported ones
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, 10)
    metrics = train_step(model, opt, sched, batch, settings)
    assert metrics["mismatch/kl_onpolicy"] < 1e-6  # no refusal: each row at its own T
    # unreported: the setting applies (and the mismatch check catches it)
    plain = rollout(model, gen, 2, 8, 3, temperature=2.0)
    assert collate(plain, 3).temperature is None
    dropped: dict[int, float] = {}
    train_step(model, opt, sched, collate(plain, 3), settings, dropped=dropped)
    assert sorted(dropped) == [0, 1]


def test_per_row_temperatures_equal_row_by_row_scalars() -> None:
    logits = torch.randn(3, 5, 7)
    tokens = torch.randint(0, 7, (3, 5))
    temps = torch.tensor([0.5, 1.0, 1.7])
    got = token_logprobs(logits, tokens, temperature=temps)
    ent = token_entropy(logits, temperature=temps)
    for b, t in enumerate(temps.tolist()):
        one = token_logprobs(logits[b : b + 1], tokens[b : b + 1], temperature=t)
        assert torch.equal(got[b], one[0])
        assert torch.equal(ent[b], token_entropy(logits[b : b + 1], temperature=t)[0])
    with pytest.raises(ValueError, match="greedy"):
        token_logprobs(logits, tokens, temperature=torch.tensor([0.5, 0.0, 1.0]))
    with pytest.raises(ValueError, match="2 temperatures for 3"):
        token_logprobs(logits, tokens, temperature=torch.tensor([0.5, 1.0]))


def test_token_logprobs_divide_by_the_temperature() -> None:
    logits = torch.randn(2, 5, 7)
    tokens = torch.randint(0, 7, (2, 5))
    want = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    got = token_logprobs(logits, tokens, temperature=0.7)
    assert torch.allclose(got[:, 1:], want, atol=1e-6) and (got[:, 0] == 0).all()
    p = torch.softmax(logits[:, :-1] / 0.7, -1)
    ent = token_entropy(logits, temperature=0.7)[:, 1:]
    assert torch.allclose(ent, -(p * p.log()).sum(-1), atol=1e-5)
    with pytest.raises(ValueError, match="greedy"):
        token_logprobs(logits, tokens, temperature=0.0)


def steps_of(
    batches: list[TrainBatch], overrides: list[str], ref: bool = False
) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """The weights of a fresh :class:`Bigram` after one step per batch, and each step's metrics
    (timings left out)."""
    base = ["precision=fp32", "optimizer.lr=0.2", "sampling.max_onpolicy_mismatch_kl=null"]
    settings = ExperimentSettings.load(None, [*base, *overrides])
    model = Bigram()
    torch.nn.init.normal_(model.table.weight, generator=torch.Generator().manual_seed(0))
    reference = frozen_reference(Bigram()) if ref else None
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, 10)
    metrics = []
    for batch in batches:
        m = train_step(model, opt, sched, batch, settings, ref_model=reference)
        metrics.append({k: v for k, v in m.items() if not k.startswith(("time/", "step/tok"))})
    return model.table.weight.detach().clone(), metrics


def test_a_token_budget_changes_the_passes_not_the_step() -> None:
    batches = [
        collate(varied_groups([[2, 9, 3, 7], [5, 5, 2, 8], [4, 6, 3, 2]], seed)) for seed in (0, 1)
    ]
    assert len(micro_batches(batches[0], 8)) == 2
    assert len(micro_batches(batches[0], 8, 12)) == 9  # the 9-token row alone, and others
    weights, metrics = steps_of(batches, ["batch.micro_batch_size=8"])
    budget, budget_metrics = steps_of(
        batches, ["batch.micro_batch_size=8", "batch.micro_batch_tokens=12"]
    )
    torch.testing.assert_close(budget, weights, rtol=1e-6, atol=1e-7)
    for m, b in zip(metrics, budget_metrics, strict=True):
        assert b.keys() == m.keys()
        assert b == pytest.approx(m, rel=1e-5, abs=1e-7)


def test_a_filler_trains_nothing_and_counts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    batches = [collate(varied_groups([[2, 9, 3], [5, 4, 6]], seed)) for seed in (0, 1)]
    args = ["batch.micro_batch_size=2", "loss.kl_coef=0.1"]
    weights, metrics = steps_of(batches, args, ref=True)

    def padded(
        batch: TrainBatch, ctx: DistContext, size: int, max_tokens: int | None
    ) -> list[MicroBatch]:
        pad = MicroBatch(filler(batch), filler=True)
        return [pad, *rank_micro_batches(batch, ctx, size, max_tokens), pad]

    monkeypatch.setattr(step_module, "rank_micro_batches", padded)
    padded_weights, padded_metrics = steps_of(batches, args, ref=True)
    assert torch.equal(padded_weights, weights)
    assert padded_metrics == metrics
    # fillers alone: not a single nonzero gradient, no loss statistics
    monkeypatch.setattr(
        step_module, "rank_micro_batches", lambda batch, *_: [MicroBatch(filler(batch), True)]
    )
    model = Bigram()
    torch.nn.init.normal_(model.table.weight, generator=torch.Generator().manual_seed(0))
    settings = ExperimentSettings.load(None, ["precision=fp32"])
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, 10)
    m = train_step(model, opt, sched, batches[0], settings)
    assert m["step/grad_norm"] == 0.0 and "loss" not in m and "sequences" not in m
