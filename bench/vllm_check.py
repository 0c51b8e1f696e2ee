"""Check the vllm engine on a GPU machine: bit-identical sync, the wire path, processed logprobs.

Needs a CUDA GPU and the ``vllm`` extra (``pip install -e '.[vllm]'``: vLLM 0.33.0, torch
2.14.0). Nothing is downloaded unless ``--model`` names a Hub id: by default a random 4-layer
Llama config is written to a temporary directory (vLLM runs without a tokenizer here).

1. A local bucket gets an anchor of random bf16 weights (the model's architecture), then
   ``--versions`` compact deltas of ``--density`` changed elements, published one by one; the
   ``VllmEngine`` follows them through ``WeightSync`` while generating (a background sync per
   version): after each, the state digest of vLLM's weights (read through the engine's Hugging
   Face-named views) must be the published one. Paused window and verify times are reported.
2. The wire path: one more delta goes through vLLM's own ``start_weight_update`` /
   ``update_weights`` / ``finish_weight_update`` into the deltarl backend; its
   ``deltarl_report`` RPC must say verified, with the trainer's state digest.
3. Processed logprobs: completions sampled at (temperature, top_p) = (1.0, 1.0) and
   (0.7, 0.9) are re-scored by the transformers model holding the same weights on the GPU,
   with the same temperature / top-p processing; max and mean absolute differences are
   reported (kernels differ, so expect ~1e-2, not 0).

Runs on any machine with a CUDA GPU and vLLM 0.33.0. The result goes to
``bench/results/vllm_check_<gpu>_<model>.json`` (the default model: ``llama-<M>m``; ``--json`` for
another path), which a rerun overwrites.

Usage::

    python bench/vllm_check.py
    python bench/vllm_check.py --model Qwen/Qwen3-0.6B --versions 8 --density 0.01

Exit status 1 if a digest differs or the wire path fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import gpu_tag, meta, result_path, write_json

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.engines import SamplingParams, VllmEngineSettings, make_engine
from deltarl.rollout.engines.vllm_engine import VllmEngine
from deltarl.rollout.engines.vllm_transfer import encode_message
from deltarl.rollout.sync.weights import WeightSync
from deltarl.weightsync.anchor import encode_anchor
from deltarl.weightsync.codec.formats import FORMAT_TAGS, encode_delta
from deltarl.weightsync.delta import compute_delta
from deltarl.weightsync.digest import state_digest
from deltarl.weightsync.reader import BucketReader
from deltarl.weightsync.writer import BucketWriter, NewObject


def tiny_llama(directory: Path) -> str:
    import transformers

    transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ).save_pretrained(directory)
    return str(directory)


def perturb(state: dict[str, torch.Tensor], seed: int, density: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        bits = t.view(torch.int16).clone()
        mask = torch.rand(bits.shape, generator=g) < density
        bits[mask] += torch.randint(1, 3, bits.shape, generator=g, dtype=torch.int16)[mask]
        out[name] = bits.view(t.dtype)
    return out


def processed_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float
) -> torch.Tensor:
    """Logprob of ``tokens`` under softmax(logits / T) restricted to the top-p nucleus."""
    z = logits.float() / temperature
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return torch.log_softmax(z, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF id or directory (default: a random 4-layer Llama)")
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--model-impl", default="auto", choices=["auto", "vllm", "transformers"])
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--json", type=Path, help="default: see the docstring")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix="deltarl-vllm-check-"))
    model = args.model or tiny_llama(tmp / "model")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch.bfloat16)
    states = {0: {n: p.detach().clone() for n, p in hf.named_parameters()}}
    numel = sum(t.numel() for t in states[0].values())
    bucket = LocalBucket(tmp / "bucket")
    publisher = BucketWriter(bucket, anchor_every=0)

    def publish(v: int, objects: list[NewObject]) -> None:
        publisher.publish(
            v, objects, state_digest=state_digest(states[v]), numel=numel, full_bytes=2 * numel
        )

    publish(0, [NewObject("anchor", "safetensors", encode_anchor(states[0], 0))])
    engine = make_engine(
        VllmEngineSettings(model=model, model_impl=args.model_impl, enforce_eager=args.eager)
    )
    result: dict[str, Any] = {"model": model, "numel": numel, "density": args.density}
    failures: list[str] = []
    sync = WeightSync(engine, BucketReader(bucket))
    sync.sync_to()
    prompts = [[1 + i, 2 + i, 3 + i] for i in range(8)]
    spans = 0
    for v in range(1, args.versions + 1):
        states[v] = perturb(states[v - 1], seed=v, density=args.density)
        d = compute_delta(states[v - 1], states[v], v - 1, v)
        blob = encode_delta(d, states[v - 1], "compact")
        tag = FORMAT_TAGS["compact"]
        publish(v, [NewObject("delta", tag, blob, v - 1, d.base_digest, d.changed)])
        future = sync.sync_in_background(v)
        out = sync.generate(prompts, SamplingParams(max_new_tokens=64, seed=v))
        future.result()
        spans += sum(c.version_min != c.version_max for c in out)
        if state_digest(engine.named_parameters()) != state_digest(states[v]):
            failures.append(f"v{v}: vLLM's weights differ from the trainer's")
    pauses = sorted(t.pause_s * 1e3 for t in sync.timings if t.kind == "delta")
    result["sync"] = {
        "versions": args.versions,
        "pause_ms_p50": statistics.median(pauses),
        "pause_ms_max": pauses[-1],
        "verify_ms_p50": statistics.median(
            t.verify_s * 1e3 for t in sync.timings if t.kind == "delta"
        ),
        "generations_spanning_a_sync": spans,
    }
    sync.close()

    # the wire path, through vLLM's own weight-update calls
    last = args.versions
    new = perturb(states[last], seed=1000, density=args.density)
    assert isinstance(engine, VllmEngine)
    llm = engine.llm
    llm.start_weight_update()
    llm.update_weights(
        {"update_info": encode_message(compute_delta(states[last], new, last, last + 1))}
    )
    llm.finish_weight_update()
    (report,) = llm.collective_rpc("deltarl_report")
    result["wire"] = report
    if not report or report["state_digest"] != state_digest(new):
        failures.append(f"wire path: report {report} does not carry the trainer's digest")
    if state_digest(engine.named_parameters()) != state_digest(new):
        failures.append("wire path: vLLM's weights differ from the trainer's")

    # processed logprobs, re-scored by the transformers model with the same weights
    hf = hf.to("cuda")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(new[name])
    diffs: dict[str, dict[str, float]] = {}
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        params = SamplingParams(max_new_tokens=32, temperature=temperature, top_p=top_p, seed=1)
        errs = []
        for prompt, c in zip(prompts, engine.generate(prompts, params), strict=True):
            ids = torch.tensor([prompt + c.token_ids], device="cuda")
            with torch.no_grad():
                logits = hf(ids).logits[0, len(prompt) - 1 : -1]
            ref = processed_logprobs(logits, ids[0, len(prompt) :], temperature, top_p)
            errs += (ref.cpu() - torch.tensor(c.logprobs)).abs().tolist()
        diffs[f"T={temperature},top_p={top_p}"] = {"max": max(errs), "mean": statistics.mean(errs)}
    result["logprob_abs_diff"] = diffs
    result["failures"] = failures
    engine.close()
    print(json.dumps(result, indent=2))
    name = Path(args.model).name.lower() if args.model else f"llama-{round(numel / 1e6)}m"
    out = args.json or result_path("vllm_check", gpu_tag(1), name)
    write_json(out, {"meta": meta(gpus=1), **result})
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
