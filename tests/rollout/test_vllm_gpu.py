"""The vllm engine against real vLLM 0.33.0 on a CUDA GPU (marked ``gpu``: CI never runs them).

Run on a GPU machine with vLLM installed: ``pytest -m gpu tests/rollout/test_vllm_gpu.py``.
When they last passed, and where, is recorded in docs/vllm.md.

* Models as vLLM lays them out: Llama (untied, and tied with a vocabulary vLLM pads) and Qwen3
  (tied, padded vocabulary, q/k norms) follow a bucket bit-exactly through the fused
  parameters, and the processed logprobs vLLM returns match the transformers model holding the
  trainer's weights (a wrong view would move them by far more than the kernels' noise).
* Async scheduling with CUDA graphs: versions alternate between normal weights and weights
  whose final norm is zero (every logit 0: each sampled token's logprob is log_softmax(0), the
  same float for every token; a token sampled by normal weights lands within 2e-5 of it with a
  probability of about 1e-6);
  while syncs land in the middle of generation, every completion's first and last token must
  be of the kind its stamp says.
* Prefix caching, salted per weight state: prompts admitted again under the same weights reuse
  their KV blocks (vLLM's ``num_cached_tokens``), prompts admitted after a sync reuse none,
  also after a sync that landed mid-generation.
"""

from __future__ import annotations

import statistics
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from rollout_helpers import FakeTrainer, same_bits

from deltarl.rollout.engines import SamplingParams, VllmEngineSettings, make_engine
from deltarl.rollout.sync.weights import WeightSync
from deltarl.weightsync.reader import BucketReader

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _needs_vllm_on_a_gpu() -> None:
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _common() -> dict[str, Any]:
    # initializer_range 0.2: peaked distributions, so a wrong mapping shows in the logprobs
    return {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.2,
    }


LAYOUTS = {
    "llama-untied": lambda: transformers.LlamaConfig(
        vocab_size=32000, tie_word_embeddings=False, architectures=["LlamaForCausalLM"], **_common()
    ),
    "llama-tied-padded-vocab": lambda: transformers.LlamaConfig(
        vocab_size=32003, tie_word_embeddings=True, architectures=["LlamaForCausalLM"], **_common()
    ),
    "qwen3-tied-padded-vocab": lambda: transformers.Qwen3Config(
        vocab_size=1000,
        head_dim=64,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
        **_common(),
    ),
}


def _state(cfg: Any, seed: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return hf, {n: p.detach().clone() for n, p in hf.named_parameters()}


def _engine(model_dir: Path, **kwargs: Any) -> Any:
    return make_engine(
        VllmEngineSettings(
            model=str(model_dir), gpu_memory_utilization=0.1, max_model_len=512, **kwargs
        )
    )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_follow_the_trainer_bit_exactly_and_sample_its_distribution(
    layout: str, tmp_path: Path, bucket: Any
) -> None:
    cfg = LAYOUTS[layout]()
    cfg.save_pretrained(tmp_path / "model")
    hf, v0 = _state(cfg)
    trainer = FakeTrainer(bucket, v0)
    engine = _engine(tmp_path / "model", enforce_eager=True)
    try:
        sync = WeightSync(engine, BucketReader(bucket))
        sync.sync_to()
        trainer.step()
        trainer.step()
        report = sync.sync_to()
        assert report.version == 2 and [s.kind for s in report.steps] == ["delta", "delta"]
        assert same_bits(dict(engine.named_parameters()), trainer.states[2])
        prompts = [[5 + i, 17, 99, 3, 250 + i] for i in range(8)]
        out = sync.generate(prompts, SamplingParams(max_new_tokens=24, seed=0))
        assert all(sync.check(c) == "verified" and c.version_max == 2 for c in out)
    finally:
        engine.close()
    print(f"{layout}: " + check_logprobs(hf, trainer.states[2], prompts, out))


def _swap_gate_up(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's weights seen through a wrong mapping (layer 0's gate and up swapped)."""
    out = dict(state)
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    out[gate], out[up] = state[up], state[gate]
    return out


def check_logprobs(
    hf: Any, state: dict[str, torch.Tensor], prompts: list[list[int]], out: list[Any]
) -> str:
    """vLLM's processed logprobs (T=1) against the transformers model holding ``state``, and
    against the same model holding a wrongly mapped state: the first must be kernel noise, far
    below the second (so the comparison can tell a right mapping from a wrong one)."""
    hf = hf.to("cuda")
    means = {}
    for label, weights in (("right", state), ("wrong", _swap_gate_up(state))):
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.copy_(weights[name])
        diffs = []
        for prompt, c in zip(prompts, out, strict=True):
            ids = torch.tensor([prompt + c.token_ids], device="cuda")
            with torch.no_grad():
                logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])
            diffs += (ref.squeeze(-1).cpu() - torch.tensor(c.logprobs)).abs().tolist()
        means[label] = statistics.mean(diffs)
        if label == "right":
            worst = max(diffs)
    assert means["right"] < 0.15 and worst < 1.0, means
    assert means["wrong"] > 4 * means["right"], means
    return f"|logprob diff| mean {means['right']:.4f} (max {worst:.3f}), wrong mapping {means['wrong']:.3f}"


def test_async_scheduling_stamps_every_token_with_the_weights_that_sampled_it(
    tmp_path: Path, bucket: Any
) -> None:
    cfg = LAYOUTS["llama-untied"]()
    cfg.save_pretrained(tmp_path / "model")
    _, v0 = _state(cfg)
    flat = {n: (torch.zeros_like(t) if n == "model.norm.weight" else t) for n, t in v0.items()}
    trainer = FakeTrainer(bucket, v0)
    versions = 12
    for v in range(1, versions + 1):  # odd versions: every logit 0
        trainer.publish(v, dict(flat if v % 2 else v0), base=v - 1)
    # every logit 0: the processed logprob is log_softmax(0) in float32, the same for all tokens
    uniform = float(torch.log_softmax(torch.zeros(cfg.vocab_size), 0)[0])
    engine = _engine(tmp_path / "model")  # CUDA graphs, async scheduling: the defaults
    spans = checked = 0
    try:
        sync = WeightSync(engine, BucketReader(bucket))
        sync.sync_to(0)
        prompts = [[7 + i, 11, 13] for i in range(64)]
        for v in range(1, versions + 1):
            future = sync.sync_in_background(v)
            while True:
                done = future.done()
                for c in sync.generate(prompts, SamplingParams(max_new_tokens=6)):
                    kinds = [abs(lp - uniform) < 2e-5 for lp in c.logprobs]
                    assert c.first.version is not None and c.last.version is not None
                    assert kinds[0] == (c.first.version % 2 == 1), (c.first, c.logprobs)
                    assert kinds[-1] == (c.last.version % 2 == 1), (c.last, c.logprobs)
                    if c.first.version == c.last.version:
                        assert len(set(kinds)) == 1, (c.first, c.logprobs)
                    else:
                        spans += 1
                        # kinds change at most once per sync in between
                        switches = sum(a != b for a, b in pairwise(kinds))
                        assert switches <= c.last.version - c.first.version
                    checked += 1
                if done:
                    break
            future.result()
    finally:
        engine.close()
    print(f"async stamps: {checked} completions checked, {spans} spanned a sync")
    assert spans > 0  # syncs did land mid-generation


def test_prefix_cache_is_reused_under_one_weight_state_and_never_across_a_sync(
    tmp_path: Path, bucket: Any
) -> None:
    """Prefix caching on (the default), salted per weight state: the same prompts admitted
    again under the same weights reuse their KV blocks (vLLM's own ``num_cached_tokens``);
    admitted after a sync, none of them reuses a block computed before it, also when the sync
    landed in the middle of a generation."""
    cfg = LAYOUTS["llama-untied"]()
    cfg.save_pretrained(tmp_path / "model")
    _, v0 = _state(cfg)
    trainer = FakeTrainer(bucket, v0)
    engine = _engine(tmp_path / "model", enforce_eager=True)
    g = torch.Generator().manual_seed(5)
    # 200 tokens: at least one full KV block whatever the attention backend's block size
    prompts = [torch.randint(10, 30000, (200,), generator=g).tolist() for _ in range(8)]
    params = SamplingParams(max_new_tokens=8, seed=0)
    calls: list[tuple[str, int | None, list[int | None]]] = []  # (label, admitted under, cached)
    try:
        sync = WeightSync(engine, BucketReader(bucket))
        sync.sync_to()

        def run(label: str, p: SamplingParams = params) -> list[Any]:
            out = sync.generate(prompts, p)
            assert len({c.first for c in out}) == 1  # one call: one admission stamp
            calls.append((label, out[0].first.version, list(engine.last_cached_tokens)))
            return out

        run("v0")
        run("v0 again")
        trainer.step()
        sync.sync_to()
        run("after a sync")
        run("again")
        trainer.step()
        future = sync.sync_in_background()  # lands while these generate (or just before)
        spanning = run("a sync lands meanwhile", SamplingParams(max_new_tokens=300, seed=1))
        future.result()
        run("after it")
        run("again")
    finally:
        engine.close()
    spans = sum(c.version_min != c.version_max for c in spanning)
    print(
        f"prefix cache (label, admitted under, cached tokens per request), {spans} spans: {calls}"
    )
    seen: set[int | None] = set()
    for label, version, cached in calls:
        if version in seen:  # same weights as an earlier call: its blocks are reused
            assert all(n is not None and n >= 64 for n in cached), (label, calls)
        else:  # admitted after a sync: no block computed before it is reused
            assert all(n == 0 for n in cached), (label, calls)
        seen.add(version)
    assert [v for _, v, _ in calls][:4] == [0, 0, 1, 1] and calls[-1][1] == 2


@pytest.mark.parametrize("layout", ["llama-tied-padded-vocab", "qwen3-tied-padded-vocab"])
def test_tensor_parallel_2_patches_every_ranks_shard_bit_exactly(
    layout: str, tmp_path: Path, bucket: Any
) -> None:
    """TP=2 (vLLM's worker processes, one shard per rank): anchor + 3 deltas, each verified per
    shard against the host mirror; then every tensor of both ranks against the trainer's state,
    and the sampled tokens' logprobs against the transformers model holding it."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cfg = LAYOUTS[layout]()
    cfg.save_pretrained(tmp_path / "model")
    hf, v0 = _state(cfg)
    trainer = FakeTrainer(bucket, v0)
    engine = _engine(tmp_path / "model", tensor_parallel_size=2, enforce_eager=True)
    try:
        shards = engine.sharded_weights()
        assert shards is not None and shards.ranks == 2
        emb = shards.boxes[1]["model.embed_tokens.weight"]
        assert emb.start[0] + emb.size[0] == cfg.vocab_size  # last rank: fewer real rows
        sync = WeightSync(engine, BucketReader(bucket))
        sync.sync_to()
        prompts = [[5 + i, 17, 99, 3, 250 + i] for i in range(8)]
        for _ in range(3):
            trainer.step()
            future = sync.sync_in_background()
            sync.generate(prompts, SamplingParams(max_new_tokens=16, seed=1))
            future.result()
        assert sync.version == 3 and sync.healthy
        assert shards.mismatches(list(v0), trainer.states[3]) == []
        out = sync.generate(prompts, SamplingParams(max_new_tokens=24, seed=0))
        assert all(sync.check(c) == "verified" and c.version_max == 3 for c in out)
    finally:
        engine.close()
    print(f"tp=2 {layout}: " + check_logprobs(hf, trainer.states[3], prompts, out))


def _score_diffs(got: list[Any], want: list[Any]) -> tuple[list[float], list[bool]]:
    """|logprob differences| (sampled tokens and the top-k) and top-1 agreement of two
    ``score_batch`` answers to the same items."""
    diffs: list[float] = []
    top1: list[bool] = []
    for a, b in zip(got, want, strict=True):
        assert len(a.sampled) == len(b.sampled)
        diffs += (torch.tensor(a.sampled) - torch.tensor(b.sampled)).abs().tolist()
        diffs += (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().flatten().tolist()
        top1 += [x[0] == y[0] for x, y in zip(a.ids, b.ids, strict=True)]
    return diffs, top1


@pytest.mark.parametrize("tp", [1, 2])
def test_score_batch_matches_the_transformers_engine(tp: int, tmp_path: Path, bucket: Any) -> None:
    """``VllmEngine.score_batch`` (vLLM's prompt logprobs) against ``TransformersEngine`` on the
    same weights, with the bound the generation path is held to (``check_logprobs``: the two
    engines' bf16 kernels differ by 0.04-0.07 on these peaked random models) and the same proof
    that the bound can tell: through a wrongly mapped state the difference is over 4x larger.
    And against vLLM itself: the logprobs of tokens vLLM sampled, scored again by
    ``score_batch`` (prefill instead of decode, same kernels family), and the stamp of the
    weights that scored."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    from deltarl.rollout.engines.transformers_engine import TransformersEngine

    cfg = LAYOUTS["llama-tied-padded-vocab"]()
    cfg.save_pretrained(tmp_path / "model")
    hf, v0 = _state(cfg)
    trainer = FakeTrainer(bucket, v0)
    trainer.step()
    engine = _engine(tmp_path / "model", tensor_parallel_size=tp, enforce_eager=True)
    try:
        sync = WeightSync(engine, BucketReader(bucket))
        sync.sync_to()
        g = torch.Generator().manual_seed(3)
        items = [
            (torch.randint(10, 30000, (n,), generator=g).tolist(), n // 2) for n in (12, 40, 200)
        ]
        got = engine.score_batch(items, 20, gate=sync)
        prompts = [[5 + i, 17, 99, 3, 250 + i] for i in range(8)]
        out = sync.generate(prompts, SamplingParams(max_new_tokens=24, seed=0))
        again = engine.score_batch(
            [(p + c.token_ids, len(p)) for p, c in zip(prompts, out, strict=True)], 1, gate=sync
        )
    finally:
        engine.close()
    self_diffs = [
        abs(x - y)
        for c, a in zip(out, again, strict=True)
        for x, y in zip(c.logprobs, a.sampled, strict=True)
    ]
    hf = hf.to("cuda")
    stats = {}
    for label, weights in (
        ("right", trainer.states[1]),
        ("wrong", _swap_gate_up(trainer.states[1])),
    ):
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.copy_(weights[name])
        diffs, top1 = _score_diffs(got, TransformersEngine(hf).score_batch(items, 20))
        stats[label] = (statistics.mean(diffs), max(diffs), statistics.mean(top1))
    (mean, worst, agree), wrong = stats["right"], stats["wrong"][0]
    self_mean, self_worst = statistics.mean(self_diffs), max(self_diffs)
    print(
        f"score tp={tp}: vs transformers |logprob diff| mean {mean:.4f} max {worst:.3f}, top-1 "
        f"agree {agree:.3f}; wrong mapping {wrong:.3f}; vs vLLM's own sampled logprobs mean "
        f"{self_mean:.4f} max {self_worst:.3f}"
    )
    assert all(a.stamp.version == 1 for a in got + again)
    assert mean < 0.15 and worst < 1.0 and agree > 0.9, stats
    assert wrong > 4 * mean, stats
    assert self_mean < 0.15 and self_worst < 1.0, (self_mean, self_worst)
