"""The default teacher engine: a Hugging Face causal LM in this process (CPU or GPU).

One batch is one forward: the sequences are right-padded to the longest (pad positions are
masked and come after every real token, so causal attention never sees them and each row's
positions are 0..len-1, exactly as alone), under ``torch.inference_mode``. Only the logit
columns from the earliest scored position on are computed (``logits_to_keep``, where the model
takes it), and of those only the rows that predict a scored token are kept. Each kept row is
divided by its sequence's temperature in float32, ``log_softmax``-ed, and reduced to the
sampled token's logprob and the top-k (``torch.topk``, most likely first), a bounded number of
rows at a time so that ``[rows, vocab]`` float32 stays small.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

import numpy as np
import torch

from deltarl.teacher.engines.base import ScoreJob, Scores

logger = logging.getLogger(__name__)

ROW_CHUNK_ELEMENTS = 1 << 25  # float32 elements of one post-processing chunk (128 MiB)


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> ``cuda`` if available else ``cpu``; anything else as ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use 'cpu'")
    return dev


class TransformersTeacher:
    """A causal LM (already on its device) scoring batches of sequences."""

    engine = "transformers"

    def __init__(self, model: torch.nn.Module, model_name: str = "model") -> None:
        model.eval()
        self.model = model
        self.model_name = model_name
        embeddings = model.get_input_embeddings()  # type: ignore[operator]
        self.vocab_size = int(embeddings.weight.shape[0])
        self.device = next(model.parameters()).device
        accepted = inspect.signature(model.forward).parameters
        self._keep = "logits_to_keep" in accepted
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls, model: str, *, gguf_file: str | None, device: str, dtype: str, name: str
    ) -> TransformersTeacher:
        """Load a checkpoint (a directory or a Hub id; a GGUF file is dequantized)."""
        import transformers
        from transformers import AutoModelForCausalLM

        dev = resolve_device(device)
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_arg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        kwargs: dict[str, Any] = {dtype_arg: getattr(torch, dtype), "attn_implementation": "sdpa"}
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
        loaded: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model, **kwargs)
        loaded.to(dev)
        logger.info(
            "teacher: %s on %s, %s, %.1fM parameters",
            name,
            dev,
            dtype,
            sum(p.numel() for p in loaded.parameters()) / 1e6,
        )
        return cls(loaded, model_name=name)

    def check_temperature(self, temperature: float) -> str | None:
        return None

    def close(self) -> None:
        """Nothing beyond this process's memory to free."""

    def score(self, jobs: list[ScoreJob]) -> list[Scores]:
        if not jobs:
            return []
        n = len(jobs)
        width = max(len(j.tokens) for j in jobs)
        ids = np.zeros((n, width), dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        for i, j in enumerate(jobs):
            ids[i, : len(j.tokens)] = j.tokens
            mask[i, : len(j.tokens)] = 1
        # logit column c predicts token c + 1: job i needs columns prompt_len - 1 .. len - 2
        first = min(j.prompt_len for j in jobs) - 1
        kwargs: dict[str, Any] = {}
        col0 = 0
        if self._keep:
            kwargs["logits_to_keep"] = width - first
            col0 = first
        rows, targets, temps = [], [], []
        for i, j in enumerate(jobs):
            cols = np.arange(j.prompt_len - 1, len(j.tokens) - 1)
            rows.append(i * (width - col0) + cols - col0)
            targets.append(j.tokens[j.prompt_len :])
            temps.append(np.full(len(cols), j.temperature, dtype=np.float32))
        kmax = min(max(j.top_k for j in jobs), self.vocab_size)
        with self._lock, torch.inference_mode():
            out = self.model(
                input_ids=torch.from_numpy(ids).to(self.device),
                attention_mask=torch.from_numpy(mask).to(self.device),
                use_cache=False,
                **kwargs,
            )
            logits = out.logits
            vocab = logits.shape[-1]
            flat = logits.reshape(-1, vocab)
            row_idx = torch.from_numpy(np.concatenate(rows)).to(self.device)
            target = torch.from_numpy(np.concatenate(targets).astype(np.int64)).to(self.device)
            temp = torch.from_numpy(np.concatenate(temps)).to(self.device)
            total = len(row_idx)
            sampled = np.empty(total, dtype=np.float32)
            top_ids = np.empty((total, kmax), dtype=np.int32)
            top_lps = np.empty((total, kmax), dtype=np.float32)
            step = max(1, ROW_CHUNK_ELEMENTS // vocab)
            for a in range(0, total, step):
                b = min(total, a + step)
                x = flat.index_select(0, row_idx[a:b]).float() / temp[a:b, None]
                lp = torch.log_softmax(x, dim=-1)
                sampled[a:b] = lp.gather(1, target[a:b, None]).squeeze(1).cpu().numpy()
                if kmax:
                    values, indices = lp.topk(kmax, dim=-1)
                    top_ids[a:b] = indices.to(torch.int32).cpu().numpy()
                    top_lps[a:b] = values.cpu().numpy()
        results = []
        row = 0
        for j in jobs:
            k = min(j.top_k, kmax)
            m = j.scored
            results.append(
                Scores(
                    sampled=sampled[row : row + m],
                    top_ids=top_ids[row : row + m, :k],
                    top_logprobs=top_lps[row : row + m, :k],
                )
            )
            row += m
        return results
