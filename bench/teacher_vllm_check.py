"""The teacher service with its vLLM engine, end to end, against the transformers engine.

Needs a CUDA GPU (two: the reference runs on the second when there is one) and vLLM 0.33.0.
Writes ``bench/teacher_engine_bench.py``'s random Llama shaped like SmolLM2-135M (head dim 64)
to a temporary directory, starts
``deltarl teacher`` with ``DELTARL_TEACHER_ENGINE=vllm`` on it, sends one request of
``--sequences`` sequences through :class:`~deltarl.teacher.client.SyncTeacherClient`, and scores
the same sequences with :class:`~deltarl.teacher.engines.transformers_engine.TransformersTeacher`
holding the same weights. Reported: |logprob difference| of the sampled tokens and of the top-k
(rank by rank), how often the top-1 ids agree, and that a temperature other than 1.0 is refused
(422). Exit status 1 when the mean difference exceeds ``--tolerance`` or top-1 agreement is
below 0.9.

In bfloat16 both engines round their logits to bf16 after different matmul kernels, so a
logprob may differ by about one bf16 spacing of its logit plus one of the largest logit (0.125
at magnitude 16-32, 0.5 at 64-128): at logits up to ~130 they differ by about 0.22 on average,
in steps of 0.125-0.25. So in bfloat16 the check also reports, per scored position, that bound
(``2 * spacing(|reference logit of the token|) + 2 * spacing(max reference logit)``, from the
reference model's own logits) and the share of positions within it (``within_bf16_bound``), and
passes on that share (>= 0.99) instead of the mean; run ``--dtype float32`` for the plain
comparison at ``--tolerance``. That bound is loose at large logits (up to 2 nats), so the float32
run decides (docs/teacher.md). To tell a different log-normalizer
from token-level differences it also reports, per position over the top-k ids both engines list,
the mean shift (vLLM minus reference; ``topk_shift_abs_mean``) and its spread (max - min;
``topk_spread_mean``, ~0 when only the normalizer differs). And, to tell whether vLLM computed
in lower precision than asked, the distance of its answers to the same weights run in bfloat16
by transformers (``vs_bf16_reference``) next to the lines of the service log that name a dtype
(``vllm_log_dtype``); ``--eager`` starts vLLM without torch.compile and CUDA graphs
(``DELTARL_TEACHER_ENFORCE_EAGER``), to tell its compiled path from its kernels.
``--embed-scale`` (default 5: logits up to ~14) scales the random model's tied embeddings; at
20 (logits up to ~130, one-hot distributions) float32 vLLM differs by ~0.08 on average
(docs/teacher.md). The check also fails when the stopped service leaves a process of its group
running (vLLM's engine core holds the GPU memory).

Runs on any machine with a CUDA GPU and vLLM 0.33.0. The result goes to
``bench/results/teacher_vllm_<gpu>_<bf16|fp32>-scale<S>[-eager].json`` (``--json`` for another
path), which a rerun overwrites.

    python bench/teacher_vllm_check.py --dtype float32 --embed-scale 5 --eager
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import gpu_tag, meta, result_path, write_json

TOKEN = "deltarl-teacher-check-token-0123456789"


def _wait_for(client: Any, proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """``/v1/info`` once the service answers (vLLM takes a minute to start)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the teacher exited with {proc.returncode}")
        try:
            info: dict[str, Any] = client.info()
            return info
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--tolerance", type=float, default=0.05, help="mean |logprob diff|")
    ap.add_argument("--json", type=Path, help="default: see the docstring")
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile/graphs")
    ap.add_argument(
        "--embed-scale",
        type=float,
        default=5.0,
        help="the random model's (tied) embeddings are multiplied by this: 5 gives logits up "
        "to ~14, 20 up to ~130 (one-hot distributions, where float32 vLLM differs by ~0.08)",
    )
    a = ap.parse_args()
    from deltarl.teacher.client import SyncTeacherClient, TeacherRequestError
    from deltarl.teacher.engines.base import ScoreJob
    from deltarl.teacher.engines.transformers_engine import TransformersTeacher

    tmp = Path(tempfile.mkdtemp(prefix="deltarl-teacher-vllm-"))
    spec = importlib.util.spec_from_file_location(
        "teacher_engine_bench", Path(__file__).with_name("teacher_engine_bench.py")
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    dtype = getattr(torch, a.dtype)
    model = bench.smollm2_shaped(dtype, "cpu", a.embed_scale)  # peaked distributions
    model.save_pretrained(tmp / "model")
    rng = np.random.default_rng(1)
    lens = rng.integers(40, 400, a.sequences)
    seqs = [rng.integers(10, 49_000, n).tolist() for n in lens]
    prompts = [int(n) // 3 for n in lens]
    env = {
        **os.environ,
        "DELTARL_TEACHER_ENGINE": "vllm",
        "DELTARL_TEACHER_MODEL": str(tmp / "model"),
        "DELTARL_TEACHER_DTYPE": a.dtype,
        "DELTARL_TEACHER_TOKEN": TOKEN,
        "DELTARL_TEACHER_PORT": str(a.port),
        "DELTARL_TEACHER_GPU_MEMORY_UTILIZATION": "0.3",
        "DELTARL_TEACHER_ENFORCE_EAGER": "true" if a.eager else "false",
        # the caller's first GPU (the reference model runs on its second when there is one)
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
    }
    log = open(tmp / "teacher.log", "w")  # noqa: SIM115 - open while the service runs
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltarl.teacher"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: what it leaves behind can be found
    )
    failures: list[str] = []
    result: dict[str, Any] = {
        "model": "random Llama, SmolLM2-135M shape",
        "dtype": a.dtype,
        "eager": a.eager,
        "embed_scale": a.embed_scale,
    }
    try:
        url = f"http://127.0.0.1:{a.port}"
        with SyncTeacherClient(url, TOKEN, deadline_s=600.0, retries=1000) as client:
            try:
                info = _wait_for(client, proc, 600.0)
            except RuntimeError:
                log.flush()
                tail = (tmp / "teacher.log").read_text(errors="replace").splitlines()[-40:]
                print("\n".join(["teacher.log (last 40 lines):", *tail]), file=sys.stderr)
                raise
            result["started_s"] = time.perf_counter() - t0
            result["info"] = info
            t1 = time.perf_counter()
            got = client.logprobs(seqs, prompts, 1.0, a.k)
            result["request_s"] = time.perf_counter() - t1
            try:
                client.logprobs(seqs[:1], prompts[:1], 0.7, a.k)
                failures.append("temperature 0.7 was not refused")
            except TeacherRequestError as err:
                result["temperature_0.7"] = f"{err.status} {err.code}"
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
        # a stopped service must not leave vLLM's engine core running (it holds the GPU memory)
        result["left_running"] = _left_running(proc.pid)
        if result["left_running"]:
            failures.append(f"the stopped service left {result['left_running']} running")
            os.killpg(proc.pid, signal.SIGKILL)
    lines = (tmp / "teacher.log").read_text(errors="replace").splitlines()
    result["vllm_log_dtype"] = [ln[-300:] for ln in lines if "dtype" in ln.lower()][:8]
    device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    ref = TransformersTeacher(model.to(device))
    jobs = [
        ScoreJob(np.asarray(s, np.int32), p, 1.0, a.k) for s, p in zip(seqs, prompts, strict=True)
    ]
    sampled, top, top1, within = [], [], [], []
    shift_mean, shift_spread = [], []
    for i, want in enumerate(ref.score(jobs)):
        s, ids, lps = got.sequence(i)
        diff = np.abs(s - want.sampled)
        sampled += diff.tolist()
        top += np.abs(lps - want.top_logprobs).ravel().tolist()
        top1 += (ids[:, 0] == want.top_ids[:, 0]).tolist()
        # per position, vLLM minus reference over the ids both list: one common shift (a
        # different log-normalizer) or differences that vary from token to token
        for r in range(ids.shape[0]):
            ref_of = dict(zip(want.top_ids[r].tolist(), want.top_logprobs[r].tolist(), strict=True))
            d = [
                lp - ref_of[t]
                for t, lp in zip(ids[r].tolist(), lps[r].tolist(), strict=True)
                if t in ref_of
            ]
            if d:
                shift_mean.append(statistics.mean(d))
                shift_spread.append(max(d) - min(d))
        if a.dtype == "bfloat16":
            bound = _bf16_bounds(model, seqs[i], prompts[i], device)
            within += (diff <= bound + 1e-3).tolist()
    result["sampled_abs_diff"] = {"mean": statistics.mean(sampled), "max": max(sampled)}
    result["topk_abs_diff"] = {"mean": statistics.mean(top), "max": max(top)}
    result["top1_agreement"] = statistics.mean(top1)
    # shift: mean over positions of |mean(vLLM - reference)| over the shared top-k ids; spread:
    # mean over positions of max - min of those differences (~0 when only the normalizer differs)
    result["topk_shift_abs_mean"] = statistics.mean(abs(x) for x in shift_mean)
    result["topk_spread_mean"] = statistics.mean(shift_spread)
    result["positions"] = len(sampled)
    if a.dtype == "float32":  # is vLLM nearer to the same weights run in bfloat16?
        ref16 = TransformersTeacher(bench.smollm2_shaped(torch.bfloat16, device, a.embed_scale))
        low = ref16.score(jobs)
        high = ref.score(jobs)
        d16 = [np.abs(got.sequence(i)[0] - w.sampled) for i, w in enumerate(low)]
        d_ref = [np.abs(w.sampled - h.sampled) for w, h in zip(low, high, strict=True)]
        result["vs_bf16_reference"] = {
            "vllm_mean": float(np.concatenate(d16).mean()),
            "fp32_reference_mean": float(np.concatenate(d_ref).mean()),
        }
    if within:
        result["within_bf16_bound"] = statistics.mean(within)
        close = result["within_bf16_bound"] >= 0.99
    else:
        close = result["sampled_abs_diff"]["mean"] <= a.tolerance
    if not close or result["top1_agreement"] < 0.9:
        failures.append("vLLM's scores are not the transformers engine's within the tolerance")
    result["tolerance_mean"] = a.tolerance
    result["failures"] = failures
    print(json.dumps(result, indent=2, default=str))
    dtype = {"float32": "fp32", "bfloat16": "bf16"}[a.dtype]
    name = f"{dtype}-scale{a.embed_scale:g}" + ("-eager" if a.eager else "")
    out = a.json or result_path("teacher_vllm", gpu_tag(1), name)
    write_json(out, json.loads(json.dumps({"meta": meta(gpus=1), **result}, default=str)))
    return 1 if failures else 0


def _left_running(pgid: int) -> list[str]:
    """Command lines of the processes still in process group ``pgid`` (Linux ``/proc``)."""
    time.sleep(5.0)  # the engine core's own shutdown after its parent's
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                left.append(f.read().replace(b"\0", b" ").decode(errors="replace").strip())
        except (OSError, ProcessLookupError):
            continue
    return left


def _bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at ``|x|`` (8 significant bits)."""
    exp = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exp - 7)


@torch.no_grad()
def _bf16_bounds(model: Any, seq: list[int], prompt: int, device: str) -> np.ndarray:
    """Per scored position of ``seq``: how far two engines that each round their logits to bf16
    may disagree on the sampled token's logprob (one spacing of that logit and one of the
    largest, each twice for safety)."""
    ids = torch.tensor([seq], device=device)
    logits = model(input_ids=ids).logits[0].float()  # row p predicts token p + 1
    rows = logits[prompt - 1 : len(seq) - 1]
    token = torch.tensor(seq[prompt:], device=device)
    own = rows.gather(1, token[:, None])[:, 0]
    bound = 2 * _bf16_spacing(own) + 2 * _bf16_spacing(rows.max(dim=1).values)
    return bound.cpu().numpy()


if __name__ == "__main__":
    raise SystemExit(main())
