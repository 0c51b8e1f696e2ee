"""Tokens/s of the vllm engine next to plain vLLM, in interleaved rounds of fresh processes.

Why rounds: the same column measured in two processes on one machine differed by up to 20%
(and vLLM's defaults by 2x across machines), more than the gaps a single run of each column
was meant to show. So every round runs every column, each in a fresh process, one after the
other (``engine``, ``llm_same``, ``llm_default``, then the next round), and the table gives each
column's median and min-max over the rounds and the engine's ratio computed *per round* (each
ratio compares processes that ran minutes apart on the same machine), then its median and
min-max.

Columns (``--columns``; the default is the first three):

* ``engine``: :class:`VllmEngine` ``.generate`` with its default settings (CUDA graphs, async
  scheduling, prefix caching salted per weight state, processed logprobs), gated by a real
  :class:`WeightSync` that loaded the weights from a bucket anchor: every guarantee on;
* ``llm_same``: ``vllm.LLM.generate`` with the engine's own ``LLM`` arguments and sampling
  parameters (``llm_kwargs``, ``request_params``, the same ``cache_salt``): vLLM's own loop on
  the engine's settings, so ``engine`` / ``llm_same`` is what the engine's step loop costs;
* ``llm_default``: ``vllm.LLM`` with vLLM's defaults (engine core in its own process, no
  logprobs, prefix caching on): ``llm_same`` / ``llm_default`` is what the engine's settings
  cost;
* on request: ``engine_sync`` (the engine without async scheduling), ``llm_inproc`` (vLLM's
  defaults in this process, as the engine runs it), ``hf`` (transformers ``generate``,
  single-turn only).

Workloads, all in every process (random-initialized model, default Qwen3-0.6B's shape; every
token sampled at temperature 1, no early stop):

* ``single bN``: batch N of ``--prompt-len`` random tokens, ``--new-tokens`` sampled each; one
  warm-up call, then ``--reps`` timed calls (new prompts each call, so no prefix is reused); the
  process's value is their median;
* ``multi-turn``: Wordle-like episodes, ``--mt-episodes`` at once for ``--mt-turns`` turns: a
  system prompt all episodes share (``--mt-system`` tokens), a first user turn of its own
  (``--mt-user``), then each turn samples a reply (``--mt-reply`` tokens) and appends it and an
  environment answer (``--mt-feedback`` tokens) to the conversation, which the next turn sends
  whole. Timed twice: ``(no reuse)`` gives every request a fresh ``cache_salt``, so every
  prompt is prefilled in full (what prefix caching off costs), ``(reuse)`` runs as the column
  does (the engine: one salt per weight state). Tokens/s counts sampled tokens;
* diagnostics (``--diagnostics``, on by default), in the same processes: in ``engine``'s, at
  ``--diag-batch``: the engine with each ``llm_engine.step()`` timed (the time the loop spends
  outside vLLM's step, per step), the engine without a gate, vLLM's own ``LLM.generate`` loop on
  the engine's ``LLM``, and the same after re-initializing the weights as vLLM's dummy loader
  does (does the anchor's weights' distribution change the speed?); in ``llm_same``'s: the same
  without logprobs at each batch (what the logprobs cost in-process). Each result also records
  the garbage collector's time and collections during the timed calls.

A ``--budget-s`` stops the run at a round boundary when the next round would not fit (the
rounds done so far are reported), ``--child-timeout-s`` bounds each process. Everything lands in
``--out-dir``: ``vllm_speed.json`` (every process's every measure, per round, with its machine
and environment), ``vllm_speed.md`` (the tables), ``logs/r<round>-<column>.log`` (each process's
output); both are rewritten after every process, so a run cut short keeps what it measured.
``--dry-run`` runs the whole orchestration with a stand-in generator (no GPU, no vLLM).

Runs on any machine with a CUDA GPU and vLLM 0.33.0. The JSON, with the date, the machine and
the command, also goes to ``bench/results/vllm_speed_<gpu>_<model>.json`` (default model:
``qwen3-0.6b``; ``--json`` for another path; a dry run writes only to ``--out-dir``), rewritten
after every process like the rest, and overwritten by a rerun.

Usage::

    python bench/vllm_speed.py                                                # 5 rounds (~15 min)
    python bench/vllm_speed.py --out-dir OUT --rounds 5 --budget-s 400 --reps 2 --mt-episodes 128
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common

COLUMNS = ("engine", "llm_same", "llm_default")  # the table's three, in each round's order
EXTRA = ("engine_sync", "llm_inproc", "hf")
ENGINES = ("engine", "engine_sync")  # columns that need the bucket's anchor
RESULT = "deltarl-vllm-speed-result: "
MT_REUSE, MT_NO_REUSE = "multi-turn (reuse)", "multi-turn (no reuse)"
RATIOS = (("engine", "llm_default"), ("engine", "llm_same"), ("llm_same", "llm_default"))


# Qwen3-0.6B's shape (also bench/rollout_sync_bench.py's and bench/vllm_tp.py's 0.6B model)
QWEN3_0_6B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}


def qwen3_0_6b(directory: Path) -> str:
    """Qwen3-0.6B's configuration (random weights are made from it)."""
    import transformers

    transformers.Qwen3Config(
        **QWEN3_0_6B,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        torch_dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],  # without it vLLM takes Qwen3 for a pooling model
    ).save_pretrained(directory)
    return str(directory)


def prompts_of(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng, margin = random.Random(seed), min(100, vocab // 10)  # no ids at either end
    return [[rng.randrange(margin, vocab - margin) for _ in range(length)] for _ in range(batch)]


def timed(run: Any, reps: int) -> dict[str, Any]:
    """Run once to warm up, then ``reps`` times; tokens/s of each timed run (bench/vllm_tp.py)."""
    run()
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        tokens = run()
        rates.append(tokens / (time.perf_counter() - t0))
    return {"tokens_per_s": statistics.median(rates), "runs": rates}


def publish_anchor(model: str, directory: Path) -> None:
    """A bucket whose version 0 is the model's random initial weights (for the engine columns)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from deltarl.buckets.local import LocalBucket
    from deltarl.weightsync.anchor import encode_anchor
    from deltarl.weightsync.digest import state_digest
    from deltarl.weightsync.writer import BucketWriter, NewObject

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model), dtype=torch.bfloat16
        )
    state = {n: p.detach().cpu() for n, p in hf.named_parameters()}
    del hf
    numel = sum(t.numel() for t in state.values())
    BucketWriter(LocalBucket(directory), anchor_every=0).publish(
        0,
        [NewObject("anchor", "safetensors", encode_anchor(state, 0))],
        state_digest=state_digest(state),
        numel=numel,
        full_bytes=2 * numel,
    )


# ------------------------------------------------------------------ runners (in a child)


class GcTimer:
    """Time the garbage collector spends, and its collections per generation, while on."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._t0 = 0.0
        self._on = False
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if not self._on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.collections[info.get("generation", 2)] += 1

    def measure(self, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
        """``fn()`` and what it cost: wall and CPU seconds, GC seconds and collections."""
        self.seconds, self.collections = 0.0, [0, 0, 0]
        self._on = True
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            out = fn()
        finally:
            self._on = False
        wall = time.perf_counter() - w0
        cost = {
            "wall_s": wall,
            "cpu_s": time.process_time() - c0,
            "gc_s": self.seconds,
            "gc_collections": list(self.collections),
        }
        return out, cost


Generated = tuple[list[list[int]], list[int | None]]  # tokens per prompt, cached prompt tokens


class Runner:
    """What a column generates with: ``generate(prompts, new_tokens, fresh_salts)``."""

    vocab = QWEN3_0_6B["vocab_size"]
    multi_turn = True

    def generate(self, prompts: list[list[int]], new_tokens: int, fresh_salts: bool) -> Generated:
        raise NotImplementedError

    def diagnostics(self, a: argparse.Namespace) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
        return []

    def close(self) -> None:
        pass


def _settings(model: str, a: argparse.Namespace, **kw: Any) -> Any:
    from deltarl.rollout.engines import VllmEngineSettings

    return VllmEngineSettings(model=model, gpu_memory_utilization=a.gpu_memory_utilization, **kw)


def _extra_llm_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """What every column's ``vllm.LLM`` gets on top of its own arguments: ``--capture-sizes``
    (fewer CUDA graphs to capture at start-up, the same for every column)."""
    if not a.capture_sizes:
        return {}
    return {"compilation_config": {"cudagraph_capture_sizes": list(a.capture_sizes)}}


def _single_rate(
    gen: Callable[[list[list[int]]], int], batch: int, a: argparse.Namespace, vocab: int, seed: int
) -> float:
    prompts = prompts_of(batch, a.prompt_len, vocab, seed)
    t0 = time.perf_counter()
    tokens = gen(prompts)
    return tokens / (time.perf_counter() - t0)


class EngineRunner(Runner):
    """The engine gated by a real WeightSync (anchor from the bucket)."""

    def __init__(self, model: str, a: argparse.Namespace, async_scheduling: bool = True) -> None:
        from deltarl.buckets.local import LocalBucket
        from deltarl.rollout.engines import make_engine, vllm_engine
        from deltarl.rollout.sync.weights import WeightSync
        from deltarl.weightsync.reader import BucketReader

        extra, own = _extra_llm_kwargs(a), vllm_engine.llm_kwargs
        if extra:  # the engine builds its vllm.LLM from llm_kwargs: add the columns' extras
            vllm_engine.llm_kwargs = lambda settings: own(settings) | extra
        self.engine: Any = make_engine(_settings(model, a, async_scheduling=async_scheduling))
        self.sync = WeightSync(self.engine, BucketReader(LocalBucket(a.bucket)))
        self.sync.sync_to()
        self.vocab = self.engine.vocab_size

    def _params(self, new_tokens: int) -> Any:
        from deltarl.rollout.engines import SamplingParams

        return SamplingParams(max_new_tokens=new_tokens, temperature=1.0)

    def generate(self, prompts: list[list[int]], new_tokens: int, fresh_salts: bool) -> Generated:
        salt_of = self.engine._salt_of
        if fresh_salts:  # one salt per request: nothing is reused
            self.engine._salt_of = lambda stamp, i: uuid.uuid4().hex
        try:
            out = self.sync.generate(prompts, self._params(new_tokens))
        finally:
            self.engine._salt_of = salt_of
        if not all(c.version_min == 0 == c.version_max for c in out):
            raise RuntimeError("a completion was not sampled by the anchor's weights")
        return [c.token_ids for c in out], list(self.engine.last_cached_tokens)

    def diagnostics(self, a: argparse.Namespace) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
        import vllm

        from deltarl.rollout.engines.vllm_engine import request_params

        engine, batch, params = self.engine, a.diag_batch, self._params(a.new_tokens)
        seeds = iter(range(10_000, 20_000))

        def rates(gen: Callable[[list[list[int]]], int]) -> dict[str, Any]:
            runs = [_single_rate(gen, batch, a, self.vocab, next(seeds)) for _ in range(a.reps)]
            return {"tokens_per_s": statistics.median(runs), "runs": runs, "batch": batch}

        def gated(prompts: list[list[int]]) -> int:
            return sum(len(c.token_ids) for c in self.sync.generate(prompts, params))

        def steps_timed() -> dict[str, Any]:
            core = engine.llm.llm_engine
            inside = [0.0, 0]  # seconds in vLLM's step(), steps
            calls = [0.0]  # seconds in generate calls
            step = core.step

            def timed_step() -> Any:
                t0 = time.perf_counter()
                try:
                    return step()
                finally:
                    inside[0] += time.perf_counter() - t0
                    inside[1] += 1

            def timed_call(prompts: list[list[int]]) -> int:
                t0 = time.perf_counter()
                try:
                    return gated(prompts)
                finally:
                    calls[0] += time.perf_counter() - t0

            core.step = timed_step
            try:
                got = rates(timed_call)
            finally:
                del core.step
            steps = max(int(inside[1]), 1)
            outside = 1e6 * (calls[0] - inside[0]) / steps  # the loop's own time, per step
            got |= {"steps": steps, "outside_step_us": outside}
            return got

        def nogate() -> dict[str, Any]:
            return rates(lambda p: sum(len(c.token_ids) for c in engine.generate(p, params)))

        def vllm_loop() -> dict[str, Any]:
            from deltarl.rollout.engines.base import WeightsStamp
            from deltarl.rollout.engines.vllm_engine import cache_salt

            held = self.sync.status()
            salt = cache_salt(WeightsStamp(held.version, held.seq))  # as the engine's requests
            sp = vllm.SamplingParams(**request_params(params, 0))

            def gen(prompts: list[list[int]]) -> int:
                inputs = [{"prompt_token_ids": p, "cache_salt": salt} for p in prompts]
                out = engine.llm.generate(inputs, sp, use_tqdm=False)
                return sum(len(o.outputs[0].token_ids) for o in out)

            return rates(gen)

        def vllm_loop_dummy_weights() -> dict[str, Any]:
            import torch

            with torch.no_grad():  # vLLM's dummy loader: uniform in [-1e-3, 1e-3]
                for t in engine.named_parameters().values():
                    t.uniform_(-1e-3, 1e-3)
            return vllm_loop()

        return [
            ("engine, steps timed", steps_timed),
            ("engine, no gate", nogate),
            ("vLLM loop on the engine's LLM", vllm_loop),
            ("vLLM loop, dummy weights", vllm_loop_dummy_weights),  # last: changes the weights
        ]

    def close(self) -> None:
        self.engine.close()


class LlmRunner(Runner):
    """Plain ``vllm.LLM.generate``: the engine's settings (``llm_same``) or vLLM's defaults."""

    def __init__(self, column: str, model: str, a: argparse.Namespace) -> None:
        import vllm

        from deltarl.rollout.engines.base import WeightsStamp
        from deltarl.rollout.engines.vllm_engine import cache_salt, llm_kwargs

        self.vllm, self.same = vllm, column == "llm_same"
        if column in ("llm_same", "llm_inproc"):  # in-process, as the engine runs it
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if self.same:
            from deltarl.rollout.engines.vllm_transfer import register

            register()
            self.llm = vllm.LLM(**llm_kwargs(_settings(model, a)), **_extra_llm_kwargs(a))
            self.salt: str | None = cache_salt(WeightsStamp(0, 1))  # one weight state
        else:
            self.llm = vllm.LLM(
                model=model,
                load_format="dummy",
                skip_tokenizer_init=True,
                seed=0,
                gpu_memory_utilization=a.gpu_memory_utilization,
                **_extra_llm_kwargs(a),
            )
            self.salt = None
        self.vocab = int(self.llm.llm_engine.model_config.get_vocab_size())

    def _params(self, new_tokens: int, logprobs: bool = True) -> Any:
        from deltarl.rollout.engines import SamplingParams
        from deltarl.rollout.engines.vllm_engine import request_params

        if not self.same:
            return self.vllm.SamplingParams(
                max_tokens=new_tokens, temperature=1.0, ignore_eos=True, detokenize=False
            )
        kw = request_params(SamplingParams(max_new_tokens=new_tokens, temperature=1.0), 0)
        if not logprobs:
            kw = {k: v for k, v in kw.items() if k not in ("logprobs", "flat_logprobs")}
        return self.vllm.SamplingParams(**kw)  # one for all, as the engine when unseeded

    def _generate(self, prompts: list[list[int]], params: Any, fresh_salts: bool) -> Generated:
        inputs: list[dict[str, Any]] = []
        for p in prompts:
            salt = uuid.uuid4().hex if fresh_salts else self.salt
            inputs.append({"prompt_token_ids": p} | ({"cache_salt": salt} if salt else {}))
        out = self.llm.generate(inputs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out], [o.num_cached_tokens for o in out]

    def generate(self, prompts: list[list[int]], new_tokens: int, fresh_salts: bool) -> Generated:
        return self._generate(prompts, self._params(new_tokens), fresh_salts)

    def diagnostics(self, a: argparse.Namespace) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
        if not self.same:
            return []
        params = self._params(a.new_tokens, logprobs=False)
        seeds = iter(range(20_000, 30_000))

        def nolp(batch: int) -> Callable[[], dict[str, Any]]:
            def run() -> dict[str, Any]:
                def gen(prompts: list[list[int]]) -> int:
                    return sum(len(t) for t in self._generate(prompts, params, False)[0])

                runs = [_single_rate(gen, batch, a, self.vocab, next(seeds)) for _ in range(a.reps)]
                return {"tokens_per_s": statistics.median(runs), "runs": runs, "batch": batch}

            return run

        return [(f"llm_same without logprobs, b{b}", nolp(b)) for b in a.batches]

    def close(self) -> None:
        from deltarl.teacher.engines.vllm_engine import shutdown_llm

        shutdown_llm(self.llm)


class HfRunner(Runner):
    """transformers ``generate`` (bf16, SDPA) on the same GPU; single-turn only."""

    multi_turn = False

    def __init__(self, model: str) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        with torch.device("cuda"):
            self.hf = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(model), dtype=torch.bfloat16, attn_implementation="sdpa"
            ).eval()

    def generate(self, prompts: list[list[int]], new_tokens: int, fresh_salts: bool) -> Generated:
        import torch

        ids = torch.tensor(prompts, device="cuda")
        with torch.no_grad():
            out = self.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                top_k=0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
            )
        torch.cuda.synchronize()
        return out[:, ids.shape[1] :].tolist(), [None] * len(prompts)


class DryRunner(Runner):
    """A stand-in for ``--dry-run``: sleeps ``DRY_S_PER_TOKEN`` per sampled token, reuses a
    prompt's blocks of 16 tokens seen before under the same salt, as vLLM would. For the tests
    of the orchestration, ``DELTARL_SPEED_DRY_FAIL=COLUMN`` fails that column's start-up,
    ``DELTARL_SPEED_DRY_HANG=COLUMN`` hangs it, ``DELTARL_SPEED_DRY_FAIL=diag`` fails a
    diagnostic."""

    DRY_S_PER_TOKEN = 2e-6

    def __init__(self, column: str) -> None:
        self.column = column
        self.seen: set[tuple[str, tuple[int, ...]]] = set()
        if os.environ.get("DELTARL_SPEED_DRY_FAIL") == column:
            raise RuntimeError(f"{column}: a start-up failure asked for by the test")
        if os.environ.get("DELTARL_SPEED_DRY_HANG") == column:
            time.sleep(3600)

    def generate(self, prompts: list[list[int]], new_tokens: int, fresh_salts: bool) -> Generated:
        cached: list[int | None] = []
        for p in prompts:
            salt = uuid.uuid4().hex if fresh_salts else self.column
            full = len(p) // 16
            hits = 0
            while hits < full and (salt, tuple(p[: 16 * (hits + 1)])) in self.seen:
                hits += 1
            self.seen.update((salt, tuple(p[: 16 * (b + 1)])) for b in range(full))
            cached.append(16 * min(hits, (len(p) - 1) // 16))
        time.sleep(self.DRY_S_PER_TOKEN * new_tokens * len(prompts) * 2)
        return [[7] * new_tokens for _ in prompts], cached

    def diagnostics(self, a: argparse.Namespace) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
        def broken() -> dict[str, Any]:
            raise RuntimeError("a diagnostic that fails (dry run): reported, the rest goes on")

        work = [("dry diagnostic", lambda: {"tokens_per_s": 1.0})]
        if os.environ.get("DELTARL_SPEED_DRY_FAIL") == "diag":
            work.insert(0, ("dry failure", broken))
        return work


def make_runner(column: str, model: str, a: argparse.Namespace) -> Runner:
    if a.dry_run:
        return DryRunner(column)
    if column in ENGINES:
        return EngineRunner(model, a, async_scheduling=column != "engine_sync")
    if column == "hf":
        return HfRunner(model)
    return LlmRunner(column, model, a)


# ------------------------------------------------------------------ workloads (in a child)


def single_turn(runner: Runner, batch: int, a: argparse.Namespace) -> dict[str, Any]:
    """One warm-up call, then ``reps`` timed calls, each on new prompts (nothing reused)."""
    rates = []
    for rep in range(a.reps + 1):
        prompts = prompts_of(batch, a.prompt_len, runner.vocab, seed=1000 * batch + rep)
        t0 = time.perf_counter()
        tokens, _ = runner.generate(prompts, a.new_tokens, fresh_salts=False)
        wall = time.perf_counter() - t0
        if rep:
            rates.append(sum(len(t) for t in tokens) / wall)
    return {"tokens_per_s": statistics.median(rates), "runs": rates, "batch": batch}


def episodes(a: argparse.Namespace, vocab: int, count: int, turns: int, seed: int) -> Any:
    """Multi-turn episodes: the first prompt of each (a shared system prompt, then its own user
    turn) and the environment's answer to each of its turns."""
    rng, margin = random.Random(seed), min(100, vocab // 10)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(margin, vocab - margin) for _ in range(n)]

    system = tokens(a.mt_system)
    firsts = [system + tokens(a.mt_user) for _ in range(count)]
    answers = [[tokens(a.mt_feedback) for _ in range(turns)] for _ in range(count)]
    return firsts, answers


def multi_turn(
    runner: Runner, a: argparse.Namespace, fresh_salts: bool, count: int, turns: int
) -> dict[str, Any]:
    """Play ``count`` episodes of ``turns`` turns at once; every turn sends each whole
    conversation and appends the reply and the environment's answer."""
    convs, answers = episodes(a, runner.vocab, count, turns, seed=count * 7919 + turns)
    generated = prompt_tokens = cached = 0
    t0 = time.perf_counter()
    for t in range(turns):
        replies, hits = runner.generate(convs, a.mt_reply, fresh_salts)
        prompt_tokens += sum(len(c) for c in convs)
        cached += sum(h or 0 for h in hits)
        generated += sum(len(r) for r in replies)
        convs = [c + r + answers[e][t] for e, (c, r) in enumerate(zip(convs, replies, strict=True))]
    wall = time.perf_counter() - t0
    return {
        "tokens_per_s": generated / wall,
        "episodes_per_s": count / wall,
        "wall_s": wall,
        "episodes": count,
        "turns": turns,
        "generated_tokens": generated,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "cached_share": cached / prompt_tokens if prompt_tokens else 0.0,
        "last_prompt_len": max(len(c) for c in convs),
    }


def process_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "pid": os.getpid(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("VLLM_", "CUDA_", "OMP_", "PYTORCH_", "TORCH_"))
        },
    }
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(
            (x.split(":", 1)[1].strip() for x in cpu.splitlines() if x.startswith("model name")),
            None,
        )
    except OSError:
        pass
    return info


def emit(record: dict[str, Any]) -> None:
    print(RESULT + json.dumps(record), flush=True)


def child(column: str, model: str, a: argparse.Namespace) -> int:
    """One column in this process: start it, then every workload; one result line each."""
    t0 = time.perf_counter()
    emit({"event": "info", "info": process_info()})
    runner = make_runner(column, model, a)
    ready: dict[str, Any] = {"event": "ready", "startup_s": time.perf_counter() - t0}
    ready["python_threads"] = threading.active_count()
    with contextlib.suppress(OSError, StopIteration):  # every thread, vLLM's and torch's too
        status = Path("/proc/self/status").read_text().splitlines()
        ready["os_threads"] = int(next(x for x in status if x.startswith("Threads:")).split()[1])
    if not a.dry_run:
        import torch

        ready["torch"] = torch.__version__
        if torch.cuda.is_initialized():  # not in llm_default's process (its core has the GPU)
            ready["device"] = torch.cuda.get_device_name(0)
        with contextlib.suppress(ImportError):
            import vllm

            ready["vllm"] = vllm.__version__
    emit(ready)
    clock = GcTimer()
    work: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (f"single b{b}", functools.partial(single_turn, runner, b, a)) for b in a.batches
    ]
    if a.multi_turn and runner.multi_turn:
        # warm-up with fresh salts (it leaves no block the timed passes could reuse), then
        # without reuse first (nor does it), then with
        work += [
            ("multi-turn warm-up", lambda: multi_turn(runner, a, True, min(16, a.mt_episodes), 2)),
            (MT_NO_REUSE, lambda: multi_turn(runner, a, True, a.mt_episodes, a.mt_turns)),
            (MT_REUSE, lambda: multi_turn(runner, a, False, a.mt_episodes, a.mt_turns)),
        ]
    if a.diagnostics:
        work += [(f"diag: {name}", fn) for name, fn in runner.diagnostics(a)]
    failed = 0
    for name, fn in work:
        try:
            result, cost = clock.measure(fn)
            emit({"event": "result", "workload": name, **result, "cost": cost})
        except Exception:
            failed += 1
            emit({"event": "error", "workload": name, "error": traceback.format_exc()[-3000:]})
            print(f"{column}: {name} failed", file=sys.stderr, flush=True)
    runner.close()
    emit({"event": "done", "total_s": time.perf_counter() - t0, "failed": failed})
    return 0


# ------------------------------------------------------------------ the parent


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max and count of ``values`` (None-free)."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": values,
    }


def summarize(rounds: list[dict[str, Any]], columns: list[str]) -> dict[str, Any]:
    """Per workload: each column's spread over the rounds, and each ratio of RATIOS computed per
    round (where both processes of that round measured it), then spread."""
    workloads: list[str] = []
    for r in rounds:
        for proc in r["processes"].values():
            for w in proc.get("results", {}):
                if w not in workloads:
                    workloads.append(w)
    out: dict[str, Any] = {}
    for w in workloads:
        row: dict[str, Any] = {"columns": {}, "ratios": {}}
        for col in columns:
            vals = [
                r["processes"][col]["results"][w]["tokens_per_s"]
                for r in rounds
                if w in r["processes"].get(col, {}).get("results", {})
            ]
            if vals:
                row["columns"][col] = spread(vals)
        for num, den in RATIOS:
            per_round = []
            for r in rounds:
                a, b = (r["processes"].get(c, {}).get("results", {}).get(w) for c in (num, den))
                if a and b and b["tokens_per_s"]:
                    per_round.append(a["tokens_per_s"] / b["tokens_per_s"])
            if per_round:
                row["ratios"][f"{num}/{den}"] = spread(per_round)
        out[w] = row
    return out


def cell(s: dict[str, Any] | None, fmt: str = "{:,.0f}") -> str:
    if not s:
        return "-"
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"


def tables(result: dict[str, Any]) -> str:
    """The markdown the run prints and writes: tokens/s per column, per-round ratios."""
    summary, columns = result["summary"], result["columns"]
    ratios = [f"{n}/{d}" for n, d in RATIOS if n in columns and d in columns]
    done = len(result["rounds"])
    lines = [
        f"tokens/s, median [min-max] over {done} round(s) of fresh processes; ratios per round"
        + (
            f"; every column with CUDA graphs of batch sizes {result['capture_sizes']} only"
            if result.get("capture_sizes")
            else ""
        ),
        "",
        "| workload | " + " | ".join(columns) + " | " + " | ".join(ratios) + " |",
        "|---|" + "---|" * (len(columns) + len(ratios)),
    ]
    mains = [w for w in summary if not w.startswith(("diag:", "multi-turn warm"))]
    for w in mains:
        row = summary[w]
        cells = [cell(row["columns"].get(c)) for c in columns]
        cells += [cell(row["ratios"].get(r), "{:.0%}") for r in ratios]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    mt = [w for w in (MT_NO_REUSE, MT_REUSE) if w in summary]
    if mt:
        lines += [
            "",
            "| multi-turn | column | episodes/s | prompt tokens reused |",
            "|---|---|---|---|",
        ]
        for w in mt:
            for col in columns:
                got = [
                    r["processes"][col]["results"][w]
                    for r in result["rounds"]
                    if w in r["processes"].get(col, {}).get("results", {})
                ]
                if got:
                    eps = spread([g["episodes_per_s"] for g in got])
                    share = spread([g["cached_share"] for g in got])
                    lines.append(
                        f"| {w} | {col} | {cell(eps, '{:.1f}')} | {cell(share, '{:.0%}')} |"
                    )
    diags = [w for w in summary if w.startswith("diag:")]
    if diags:
        lines += [
            "",
            "| diagnostic (same process as its column) | tokens/s | also |",
            "|---|---|---|",
        ]
        for w in diags:
            for col, s in summary[w]["columns"].items():
                extra = []
                got = [
                    r["processes"][col]["results"][w]
                    for r in result["rounds"]
                    if w in r["processes"].get(col, {}).get("results", {})
                ]
                outside = [g["outside_step_us"] for g in got if "outside_step_us" in g]
                if outside:
                    extra.append(f"outside vLLM's step {cell(spread(outside), '{:.0f}')} us/step")
                gc_ms = [1e3 * g["cost"]["gc_s"] for g in got if "cost" in g]
                if gc_ms:
                    extra.append(f"GC {cell(spread(gc_ms), '{:.1f}')} ms")
                lines.append(f"| {w[6:]} ({col}) | {cell(s)} | {'; '.join(extra)} |")
    starts = {
        col: [
            r["processes"][col]["startup_s"]
            for r in result["rounds"]
            if "startup_s" in r["processes"].get(col, {})
        ]
        for col in columns
    }
    lines += [
        "",
        "start-up (s): "
        + ", ".join(f"{c} {cell(spread(v), '{:.0f}')}" for c, v in starts.items() if v),
    ]
    failures = [
        f"round {r['round']} {col}: {what}"
        for r in result["rounds"]
        for col, proc in r["processes"].items()
        for what in ([proc["failure"]] if proc.get("failure") else [])
        + [f"{w} ({last_line(e)})" for w, e in proc.get("errors", {}).items()]
    ]
    if failures:
        lines += ["", "FAILED: " + "; ".join(failures)]
    if result.get("stopped"):
        lines += ["", f"stopped: {result['stopped']}"]
    return "\n".join(lines)


def last_line(text: str) -> str:
    """The last non-empty line of a traceback (the exception)."""
    return next((x.strip() for x in reversed(text.splitlines()) if x.strip()), "")


def run_child(cmd: list[str], log: Path, timeout_s: float) -> dict[str, Any]:
    """Run one column's process (its own session, killed whole on a timeout); its result lines
    parsed, whatever it printed logged."""
    proc: dict[str, Any] = {"results": {}, "errors": {}}
    t0 = time.perf_counter()
    with log.open("w") as out:
        child_proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        assert child_proc.stdout is not None
        timer = threading.Timer(timeout_s, lambda: _kill_group(child_proc.pid))
        timer.start()
        try:
            for line in child_proc.stdout:
                out.write(line)
                out.flush()
                if line.startswith(RESULT):
                    _record(proc, json.loads(line[len(RESULT) :]))
            rc = child_proc.wait()
        finally:
            timer.cancel()
            _kill_group(child_proc.pid)  # what it left behind (vLLM's engine core process)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child_proc.wait(timeout=30)
    proc["rc"], proc["wall_s"] = rc, time.perf_counter() - t0
    if rc != 0 or "done" not in proc:
        timed_out = proc["wall_s"] >= timeout_s
        proc["failure"] = (
            f"timed out after {timeout_s:.0f} s" if timed_out else f"exit code {rc}"
        ) + f" (log: {log})"
        tail = log.read_text(errors="replace").splitlines()[-25:]
        print(f"--- {log.name} failed: {proc['failure']}; its last lines:", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr, flush=True)
    return proc


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _record(proc: dict[str, Any], rec: dict[str, Any]) -> None:
    event = rec.pop("event")
    if event == "info":
        proc.setdefault("info", {}).update(rec["info"])
    elif event == "ready":
        proc["startup_s"] = rec.pop("startup_s")
        proc.setdefault("info", {}).update(rec)
    elif event == "result":
        proc["results"][rec.pop("workload")] = rec
    elif event == "error":
        proc["errors"][rec["workload"]] = rec["error"]
    elif event == "done":
        proc["done"] = rec


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out-dir", type=Path, help="where everything lands (default: a temp dir)")
    ap.add_argument(
        "--json", type=Path, help="also write the JSON here (default: see the docstring)"
    )
    ap.add_argument("--model", help="model directory or id (default: Qwen3-0.6B's shape, random)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=COLUMNS + EXTRA)
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per workload and process")
    ap.add_argument("--multi-turn", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--mt-episodes", type=int, default=256)
    ap.add_argument("--mt-turns", type=int, default=6)
    ap.add_argument("--mt-system", type=int, default=200, help="shared system prompt tokens")
    ap.add_argument("--mt-user", type=int, default=40, help="each episode's first user turn")
    ap.add_argument("--mt-reply", type=int, default=24, help="tokens sampled per turn")
    ap.add_argument("--mt-feedback", type=int, default=40, help="environment answer per turn")
    ap.add_argument("--diagnostics", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--diag-batch", type=int, default=32)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument(
        "--capture-sizes",
        type=int,
        nargs="+",
        help="CUDA graph batch sizes for every column (default: vLLM's ~50): fewer start faster",
    )
    ap.add_argument("--budget-s", type=float, help="start no round that would end after this")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="continue the rounds recorded in --out-dir (same model, bucket and settings)",
    )
    ap.add_argument("--child-timeout-s", type=float, default=900.0)
    ap.add_argument("--dry-run", action="store_true", help="stand-in generator, no GPU")
    ap.add_argument("--one", metavar="COLUMN", help=argparse.SUPPRESS)
    ap.add_argument("--publish-anchor", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bucket", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _child_argv(a: argparse.Namespace, model: str) -> list[str]:
    """The parent's settings, for a child."""
    argv = ["--model", model, "--bucket", str(a.bucket), "--batches", *map(str, a.batches)]
    for flag in (
        "prompt_len",
        "new_tokens",
        "reps",
        "mt_episodes",
        "mt_turns",
        "mt_system",
        "mt_user",
        "mt_reply",
        "mt_feedback",
        "diag_batch",
        "gpu_memory_utilization",
    ):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
    if a.capture_sizes:
        argv += ["--capture-sizes", *map(str, a.capture_sizes)]
    argv += ["--multi-turn" if a.multi_turn else "--no-multi-turn"]
    argv += ["--diagnostics" if a.diagnostics else "--no-diagnostics"]
    return argv + (["--dry-run"] if a.dry_run else [])


def _earlier_run(a: argparse.Namespace, out_dir: Path) -> dict[str, Any] | None:
    """The run recorded in ``out_dir`` that ``--resume`` continues (None if there is none).

    Its rounds stand as measured; the new rounds use its model and bucket and must use its
    settings, so that every round measures the same thing."""
    path = out_dir / "vllm_speed.json"
    if not path.exists():
        return None
    earlier: dict[str, Any] = json.loads(path.read_text())
    if "model_path" not in earlier or "bucket" not in earlier:
        raise SystemExit(f"--resume: {path} does not record its model and bucket")
    now = {k: str(v) for k, v in vars(a).items()}
    keep = set(_SETTINGS_OF_A_ROUND)
    differ = sorted(k for k in keep if earlier["args"].get(k) != now.get(k))
    if differ:
        raise SystemExit(f"--resume: settings differ from the recorded run's: {', '.join(differ)}")
    return earlier


# what a round measures: a resumed run must match the recorded one in all of these
_SETTINGS_OF_A_ROUND = (
    "columns",
    "batches",
    "prompt_len",
    "new_tokens",
    "reps",
    "multi_turn",
    "mt_episodes",
    "mt_turns",
    "mt_system",
    "mt_user",
    "mt_reply",
    "mt_feedback",
    "diagnostics",
    "diag_batch",
    "gpu_memory_utilization",
    "capture_sizes",
    "model",
    "dry_run",
)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.one:  # a child: one column
        return child(a.one, a.model, a)
    if a.publish_anchor:  # a child: the engine columns' anchor
        publish_anchor(a.model, a.bucket)
        return 0
    out_dir = a.out_dir or Path(tempfile.mkdtemp(prefix="deltarl-vllm-speed-"))
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    earlier = _earlier_run(a, out_dir) if a.resume else None
    if earlier is not None:
        model, a.bucket = earlier["model_path"], Path(earlier["bucket"])
    elif a.model is not None:
        model = a.model
    elif a.dry_run:
        model = "dry-run"
    else:
        model = qwen3_0_6b(Path(tempfile.mkdtemp(prefix="deltarl-speed-model-")))
    a.bucket = a.bucket or Path(tempfile.mkdtemp(prefix="deltarl-speed-bucket-"))
    me = [sys.executable, str(Path(__file__).resolve())]
    result: dict[str, Any] = earlier or {
        "args": {k: str(v) for k, v in vars(a).items()},
        "model": a.model or "Qwen3-0.6B shape (random)",
        "model_path": model,
        "bucket": str(a.bucket),
        "columns": a.columns,
        "capture_sizes": a.capture_sizes,
        "rounds": [],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    elapsed_before = float(result.get("elapsed_s", 0.0))
    result.pop("stopped", None)
    # every invocation that measured rounds of this run, the first one's settings in "args"
    commands = result.setdefault("commands", [])
    commands.append(common.command())

    def save() -> str:
        result["summary"] = summarize(result["rounds"], a.columns)
        result["elapsed_s"] = elapsed_before + time.perf_counter() - t_start
        table = result["table"] = tables(result)
        target = a.json
        if result.get("device"):  # known from the first process (CUDA stays out of this one)
            cpus = common.machine().partition(", ")[2]
            result["meta"] = {
                "date": result["started"][:10],
                "machine": f"1x {result['device']}, {cpus}",
                "command": " && ".join(commands),
            }
            if target is None and not a.dry_run:
                name = Path(a.model).name.lower() if a.model else "qwen3-0.6b"
                target = common.result_path("vllm_speed", common.gpu_tag(1, result["device"]), name)
        text = json.dumps(result, indent=1) + "\n"
        (out_dir / "vllm_speed.json").write_text(text)
        if target:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        (out_dir / "vllm_speed.md").write_text(table + "\n")
        return table

    if set(ENGINES) & set(a.columns) and not a.dry_run and earlier is None:
        log = out_dir / "logs" / "publish-anchor.log"
        t0 = time.perf_counter()
        with log.open("w") as f:
            rc = subprocess.run(
                [*me, "--publish-anchor", "--model", model, "--bucket", str(a.bucket)],
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=a.child_timeout_s,
            ).returncode
        result["anchor_s"] = time.perf_counter() - t0
        if rc != 0:
            result["stopped"] = f"publishing the anchor failed (exit {rc}, log: {log})"
            print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
            print(save())
            return 1
    round_s: list[float] = []
    # a SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C: the process being measured is killed
    # with its group (run_child's finally), what was measured is saved
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for r in range(len(result["rounds"]) + 1, a.rounds + 1):
            elapsed = time.perf_counter() - t_start
            if a.budget_s is not None and round_s and elapsed + max(round_s) > a.budget_s:
                result["stopped"] = (
                    f"budget: {r - 1} of {a.rounds} rounds ({elapsed:.0f} s in this process); "
                    f"one more would end "
                    f"near {elapsed + max(round_s):.0f} s (--budget-s {a.budget_s:.0f})"
                )
                break
            t_round = time.perf_counter()
            this: dict[str, Any] = {"round": r, "processes": {}}
            result["rounds"].append(this)
            for col in a.columns:
                log = out_dir / "logs" / f"r{r}-{col}.log"
                cmd = [*me, "--one", col, *_child_argv(a, model)]
                proc = this["processes"][col] = run_child(cmd, log, a.child_timeout_s)
                if proc.get("info", {}).get("device"):
                    result.setdefault("device", proc["info"]["device"])
                got = ", ".join(
                    f"{w} {x['tokens_per_s']:,.0f}"
                    for w, x in proc["results"].items()
                    if not w.startswith(("diag:", "multi-turn warm"))
                )
                bad = f"  FAILED: {proc['failure']}" if proc.get("failure") else ""
                bad += "".join(f"  FAILED {w}: {last_line(e)}" for w, e in proc["errors"].items())
                print(f"round {r} {col:12s} ({proc['wall_s']:.0f} s) {got}{bad}", flush=True)
                save()
            round_s.append(time.perf_counter() - t_round)
    except KeyboardInterrupt:
        result["stopped"] = f"interrupted after {time.perf_counter() - t_start:.0f} s"
        print(save(), flush=True)
        return 1
    table = save()
    print(table)
    print(f"results: {out_dir}/vllm_speed.json, {out_dir}/vllm_speed.md, logs in {out_dir}/logs")
    failed = any(
        p.get("failure") or p.get("errors")
        for r in result["rounds"]
        for p in r["processes"].values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
