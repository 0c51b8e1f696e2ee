"""The deltarl weight-transfer backend's vLLM-free half: wire message, in-place apply, plugin hook.

vLLM (0.33.0) picks a weight-transfer backend by name (``weight_transfer_config={"backend":
"deltarl"}``) from ``WeightTransferEngineFactory``; :func:`register` (the ``vllm.general_plugins``
entry point ``deltarl``, which vLLM runs in every one of its processes) adds ours, lazily, as
``deltarl.rollout.engines.vllm_backend.DeltarlWeightTransferEngine``. That class is a thin
subclass of vLLM's ``WeightTransferEngine`` delegating to :class:`DeltaReceiver` here, which
holds everything testable without vLLM.

Message (``update_info`` of ``update_weights``; JSON-safe, so it crosses vLLM's RPC, its HTTP
dev route ``/update_weights`` and process boundaries without pickle)::

    {"format": "deltarl-delta-v1", "base_version": 41, "version": 42,
     "tensors": [{"name": ..., "dtype": "bfloat16", "shape": [576, 576],
                  "base_digest": ..., "result_digest": ...}, ...],   # every tensor of the state
     "payload": "<base64 safetensors: '{name}.idx' int64 [k], '{name}.val' int8|16|32 [k]>"}

``payload`` holds the changed tensors only: sorted flat indices and new bit patterns, i.e. a
decoded :class:`~deltarl.weightsync.delta.Delta` (the compact codec's decode needs the
old weights on the host, which the sender has and the vLLM worker does not keep).

Order in :meth:`DeltaReceiver.apply` (inside vLLM's worker; vLLM runs it between two engine
steps, so generation is paused for all of it): base digests checked against the digests the
receiver keeps (nothing written if any differs) -> ``stage_delta`` -> ``apply_staged`` -> device
synchronize -> digests of every changed tensor recomputed and compared with the trainer's, and
the state digest with the delta's result. A failure raises (``BaseMismatchError``,
``VerificationError``), which vLLM propagates to the caller of ``update_weights``; success is an
:class:`ApplyReport`, kept as :attr:`DeltaReceiver.last_report` and returned by the worker
extension's ``deltarl_report`` RPC.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from deltarl.rollout.engines.vllm_mapping import TensorSpec, probe_shards, uncovered
from deltarl.rollout.engines.vllm_shards import Box
from deltarl.weightsync.codec.bits import float_format
from deltarl.weightsync.delta import (
    UNKNOWN_DIGEST,
    Delta,
    TensorPatch,
    apply_staged,
    stage_delta,
    verify_base,
)
from deltarl.weightsync.digest import combine_digests, state_digests
from deltarl.weightsync.errors import CorruptDeltaError, VerificationError
from deltarl.weightsync.fp8 import config_block

logger = logging.getLogger(__name__)

BACKEND_NAME = "deltarl"
MESSAGE_FORMAT = "deltarl-delta-v1"
BACKEND_MODULE = "deltarl.rollout.engines.vllm_backend"
BACKEND_CLASS = "DeltarlWeightTransferEngine"
WORKER_EXTENSION = f"{BACKEND_MODULE}.DeltarlWorkerExtension"


def register() -> None:
    """``vllm.general_plugins`` entry point: add the ``deltarl`` weight-transfer backend.

    vLLM may call it more than once per process; the module path is registered, so vLLM
    imports :mod:`.vllm_backend` only when a worker is configured with this backend.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(BACKEND_NAME, BACKEND_MODULE, BACKEND_CLASS)


# ---------------------------------------------------------------------------- wire message


def encode_message(delta: Delta) -> dict[str, Any]:
    """The JSON-safe ``update_info`` carrying ``delta`` (see the module docstring)."""
    arrays: dict[str, np.ndarray] = {}
    for p in delta.patches.values():
        if p.changed:
            arrays[f"{p.name}.idx"] = np.ascontiguousarray(p.index, dtype=np.int64)
            arrays[f"{p.name}.val"] = np.ascontiguousarray(p.value)
    return {
        "format": MESSAGE_FORMAT,
        "base_version": delta.base_version,
        "version": delta.version,
        "tensors": [
            {
                "name": p.name,
                "dtype": p.dtype,
                "shape": list(p.shape),
                "base_digest": p.base_digest,
                "result_digest": p.result_digest,
            }
            for p in delta.patches.values()
        ],
        "payload": base64.b64encode(st_save(arrays)).decode("ascii") if arrays else "",
    }


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def decode_message(message: Mapping[str, Any]) -> Delta:
    """Inverse of :func:`encode_message`; ``CorruptDeltaError`` on any inconsistency."""
    if message.get("format") != MESSAGE_FORMAT:
        raise CorruptDeltaError(
            f"update_info format {message.get('format')!r} is not {MESSAGE_FORMAT!r}"
        )
    try:
        raw = base64.b64decode(message["payload"], validate=True) if message["payload"] else b""
        arrays = st_load(raw) if raw else {}
        patches: dict[str, TensorPatch] = {}
        for t in message["tensors"]:
            spec = TensorSpec.from_json(t)
            bits = float_format(spec.dtype).bits_dtype
            index = arrays.pop(f"{spec.name}.idx", np.zeros(0, np.int64))
            value = arrays.pop(f"{spec.name}.val", np.zeros(0, bits))
            numel = int(np.prod(spec.shape, dtype=np.int64))
            if index.dtype != np.int64 or value.dtype != bits or index.shape != value.shape:
                raise CorruptDeltaError(f"{spec.name}: index/value arrays of the wrong type")
            if index.size and (np.any(np.diff(index) <= 0) or index[0] < 0 or index[-1] >= numel):
                raise CorruptDeltaError(f"{spec.name}: indices unsorted or out of range")
            patches[spec.name] = TensorPatch(
                spec.name,
                spec.dtype,
                spec.shape,
                index,
                value,
                str(t["base_digest"]),
                str(t["result_digest"]),
            )
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, CorruptDeltaError):
            raise
        raise CorruptDeltaError(f"malformed update_info: {err!r}") from err
    if arrays:
        raise CorruptDeltaError(f"payload holds arrays of no listed tensor: {sorted(arrays)[:3]}")
    return Delta(_opt_int(message.get("base_version")), _opt_int(message.get("version")), patches)


# ---------------------------------------------------------------------------- worker side


def check_supported(vllm_config: Any) -> None:
    """Raise ``ValueError`` for a configuration whose weights cannot be patched in place."""
    par, model = vllm_config.parallel_config, vllm_config.model_config
    if par.pipeline_parallel_size != 1:
        raise ValueError(
            "the deltarl weight-transfer backend supports pipeline_parallel_size=1 only (got "
            f"{par.pipeline_parallel_size}): use tensor parallelism or one engine per GPU"
        )
    if getattr(par, "enable_eplb", False):
        raise ValueError(
            "the deltarl weight-transfer backend does not support enable_eplb: vLLM's expert "
            "load balancer replicates experts and moves them between GPUs while serving, so a "
            "checkpoint expert has no fixed place to patch; expert parallelism without it "
            "(enable_expert_parallel) is supported"
        )
    quantization = getattr(model, "quantization", None)
    if not quantization:
        return
    config = getattr(getattr(model, "hf_config", None), "quantization_config", None)
    block, why = None, ""
    if quantization == "fp8":
        try:
            block = config_block(config)
        except ValueError as err:
            why = f"; {err}"
    if block is None:
        raise ValueError(
            f"the deltarl weight-transfer backend needs unquantized weights or block fp8 (got "
            f"quantization={quantization!r}{why}): bit-exact deltas patch the checkpoint's bytes"
        )
    problem = fp8_environment_problem()
    if problem is not None:
        raise ValueError(f"block fp8 with the deltarl backend: {problem}")


FP8_ENVIRONMENT = {
    "VLLM_USE_DEEP_GEMM": "0",
    "VLLM_DISABLED_KERNELS": "MarlinFP8ScaledMMLinearKernel",
}
"""What vLLM's processes need so that block-fp8 weights are served as loaded:

* ``VLLM_USE_DEEP_GEMM=0``: DeepGEMM requantizes block-fp8 weights to power-of-two (E8M0)
  scales and re-lays the scales when it loads (``fp8_utils.deepgemm_post_process_fp8_weight_
  block``);
* Marlin's fp8 kernel disabled: for blocks CUTLASS does not take (64 x 64) vLLM would choose it
  before Triton's, and it repacks the weights.

With both, Hopper serves 128 x 128 blocks with CUTLASS and 64 x 64 with Triton, each keeping the
checkpoint's e4m3 bytes and scales."""


def fp8_environment_problem(env: Mapping[str, str] | None = None) -> str | None:
    """What in ``env`` (default: this process's environment) keeps vLLM from serving block-fp8
    bytes as loaded (:data:`FP8_ENVIRONMENT`), or None."""
    env = os.environ if env is None else env
    if env.get("VLLM_USE_DEEP_GEMM", "1") != "0":
        return (
            "needs VLLM_USE_DEEP_GEMM=0 (vLLM's CUTLASS and Triton block-fp8 kernels keep the "
            "checkpoint's e4m3 bytes and scales; DeepGEMM rewrites them at load)"
        )
    if FP8_ENVIRONMENT["VLLM_DISABLED_KERNELS"] not in env.get("VLLM_DISABLED_KERNELS", "").split(
        ","
    ):
        return (
            "needs MarlinFP8ScaledMMLinearKernel in VLLM_DISABLED_KERNELS (Marlin's fp8 kernel "
            "repacks the weights it serves)"
        )
    return None


def set_fp8_environment() -> None:
    """Put :data:`FP8_ENVIRONMENT` into this process's environment, which vLLM's engine and
    worker processes inherit (call it before the engine starts); a ValueError when the
    environment asks for DeepGEMM explicitly."""
    deep_gemm = os.environ.get("VLLM_USE_DEEP_GEMM", "0")
    if deep_gemm != "0":
        raise ValueError(
            f"fp8 workers need VLLM_USE_DEEP_GEMM=0, and this process's environment sets it to "
            f"{deep_gemm!r} (DeepGEMM rewrites block-fp8 weights at load)"
        )
    os.environ["VLLM_USE_DEEP_GEMM"] = "0"
    disabled = [k for k in os.environ.get("VLLM_DISABLED_KERNELS", "").split(",") if k]
    if FP8_ENVIRONMENT["VLLM_DISABLED_KERNELS"] not in disabled:
        disabled.append(FP8_ENVIRONMENT["VLLM_DISABLED_KERNELS"])
    os.environ["VLLM_DISABLED_KERNELS"] = ",".join(disabled)


@dataclass(frozen=True, slots=True)
class ApplyReport:
    """What the worker reports after an apply: ``verified`` is only ever True here (a failed
    verification raises instead); ``state_digest`` is the xxh3 state digest of the worker's
    weights, comparable with the manifest's."""

    base_version: int | None
    version: int | None
    changed: int
    tensors_verified: int
    state_digest: str
    stage_s: float
    apply_s: float
    verify_s: float
    verified: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class DeltaReceiver:
    """Worker-side state of the backend: the Hugging Face-named views of the vLLM model, the
    digests of what they hold, the last report. ``model`` is vLLM's model; ``device`` its
    device. Not thread-safe: vLLM calls it from its one worker thread."""

    def __init__(
        self, model: torch.nn.Module, device: torch.device, *, shards: bool = False
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.shards = shards  # a tensor-parallel rank: views of its part of each tensor
        self.views: dict[str, torch.Tensor] | None = None
        self.boxes: dict[str, Box] | None = None  # the part of each tensor this rank holds
        self.digests: dict[str, str] | None = None  # None: not known (re-hash before checking)
        self.last_report: ApplyReport | None = None

    def bind(self, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
        """Map the checkpoint tensors ``specs`` onto the model (see :mod:`.vllm_mapping`)."""
        self.views, self.boxes = probe_shards(self.model, specs, shards=self.shards)
        self.digests = None
        rest = uncovered(self.model, self.views)
        if rest:
            logger.warning("deltarl: runtime parameters no checkpoint tensor maps to: %s", rest)
        logger.info("deltarl: %d checkpoint tensors mapped onto the vLLM model", len(self.views))
        return self.views

    def apply(self, message: Mapping[str, Any]) -> ApplyReport:
        """Decode, check the base, patch in place, verify (see the module docstring)."""
        delta = decode_message(message)
        if self.shards:
            raise ValueError(
                "update_weights with deltarl deltas runs at tensor_parallel_size=1 only; at TP > "
                "1 the vllm engine applies every rank's shard itself (docs/vllm.md)"
            )
        if self.views is None:
            self.bind([TensorSpec(p.name, p.dtype, p.shape) for p in delta.patches.values()])
        views = self.views
        assert views is not None
        if self.digests is None:
            self.digests = state_digests(views)
        verify_base(views, delta, state_digests=self.digests)  # nothing written on a mismatch
        t0 = time.perf_counter()
        staged = stage_delta(delta, self.device, views)
        t1 = time.perf_counter()
        try:
            apply_staged(views, staged)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except BaseException:
            self.digests = None
            raise
        t2 = time.perf_counter()
        digests = dict(self.digests)
        recheck = [
            n for n, p in delta.patches.items() if p.changed or p.base_digest != p.result_digest
        ]
        digests.update(state_digests({name: views[name] for name in recheck}))
        bad = [
            n
            for n in recheck
            if delta.patches[n].result_digest != UNKNOWN_DIGEST
            and digests[n] != delta.patches[n].result_digest
        ]
        state = combine_digests(digests)
        self.digests = digests
        if bad or state != delta.result_digest:
            what = f"{len(bad)} tensor(s) differ, e.g. {bad[:3]}" if bad else "state digest differs"
            raise VerificationError(
                f"vLLM worker: after applying v{delta.version}, {what}; its weights are not the "
                "trainer's (reload a checkpoint)"
            )
        self.last_report = ApplyReport(
            base_version=delta.base_version,
            version=delta.version,
            changed=delta.changed,
            tensors_verified=len(recheck),
            state_digest=state,
            stage_s=t1 - t0,
            apply_s=t2 - t1,
            verify_s=time.perf_counter() - t2,
        )
        return self.last_report
