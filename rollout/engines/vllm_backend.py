"""The ``deltarl`` weight-transfer backend as vLLM sees it (imports vLLM 0.33.0; loaded by vLLM).

Only vLLM imports this module: through its ``WeightTransferEngineFactory`` (registered by
:func:`deltarl.rollout.engines.vllm_transfer.register`, the ``vllm.general_plugins`` entry point)
when a worker runs with ``weight_transfer_config={"backend": "deltarl"}``, and through
``worker_extension_cls="deltarl.rollout.engines.vllm_backend.DeltarlWorkerExtension"``. All logic
is in :class:`~deltarl.rollout.engines.vllm_transfer.DeltaReceiver`; this file only adapts
vLLM's ``WeightTransferEngine`` lifecycle to it:

* ``init_transfer_engine({"tensors": [{"name", "dtype", "shape"}, ...]})``: map those checkpoint
  tensors onto the model (an empty list maps lazily, from the first update's tensor list);
* ``start_weight_update`` / ``finish_weight_update``: nothing (patches land in place; no
  layerwise reload);
* ``update_weights(message)`` -> ``receive_weights``: :meth:`DeltaReceiver.apply` (base check,
  in-place scatter, digest verification; raises on failure);
* ``shutdown``: forget the views.

Refused at construction (clear ``ValueError``): pipeline parallel > 1, quantized models (the
runtime bytes must be the checkpoint's bytes). At tensor parallel > 1 every rank maps its own
part of each tensor (:mod:`.vllm_shards`): the extension's ``deltarl_tp_serve`` starts the rank's
staging thread and returns its boxes, ``deltarl_tp_apply`` writes what was staged (called by the
rollout worker inside its pause); the ``update_weights`` route is then refused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from deltarl.rollout.engines.vllm_mapping import TensorSpec
from deltarl.rollout.engines.vllm_shards import ShardServer
from deltarl.rollout.engines.vllm_transfer import DeltaReceiver, check_supported


@dataclass
class DeltarlInitInfo(WeightTransferInitInfo):
    """``tensors``: the checkpoint tensors (JSON specs) to map; empty: from the first update."""

    tensors: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class DeltarlUpdateInfo(WeightTransferUpdateInfo):
    """One delta (``vllm_transfer.encode_message``'s fields)."""

    format: str
    base_version: int | None
    version: int | None
    tensors: list[dict[str, Any]]
    payload: str


class DeltarlWeightTransferEngine(WeightTransferEngine[DeltarlInitInfo, DeltarlUpdateInfo]):
    """vLLM ``WeightTransferEngine`` applying deltarl deltas in place (see the module docstring)."""

    init_info_cls = DeltarlInitInfo
    update_info_cls = DeltarlUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        check_supported(vllm_config)
        super().__init__(config, vllm_config, device, model)
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.receiver = DeltaReceiver(model, device, shards=tp > 1)

    def init_transfer_engine(self, init_info: DeltarlInitInfo) -> None:
        if init_info.tensors:
            with set_current_vllm_config(self.vllm_config):  # some loaders read it
                self.receiver.bind([TensorSpec.from_json(t) for t in init_info.tensors])

    def start_weight_update(self) -> None:
        """Nothing to prepare: deltas patch the initialized tensors in place."""

    def finish_weight_update(self) -> None:
        """Nothing to finalize (no layerwise reload)."""

    def receive_weights(self, update_info: DeltarlUpdateInfo) -> None:
        self.receiver.apply(asdict(update_info))

    def shutdown(self) -> None:
        self.receiver.views = None
        self.receiver.digests = None


class DeltarlWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``): RPCs for ``collective_rpc`` (and the
    dev route ``POST /collective_rpc {"method": "deltarl_report"}``)."""

    def _deltarl_receiver(self) -> DeltaReceiver:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, DeltarlWeightTransferEngine):
            raise RuntimeError(
                "this vLLM worker runs no deltarl weight-transfer backend: start it with "
                "weight_transfer_config={'backend': 'deltarl'}"
            )
        return engine.receiver

    def deltarl_report(self) -> dict[str, Any] | None:
        """JSON report of the last verified apply (None: none yet)."""
        report = self._deltarl_receiver().last_report
        return None if report is None else report.to_json()

    def deltarl_views(self) -> dict[str, torch.Tensor]:
        """The live Hugging Face-named views (in-process use only: tensors do not serialize)."""
        views = self._deltarl_receiver().views
        if views is None:
            raise RuntimeError("no tensors mapped yet: call init_weight_transfer_engine first")
        return views

    def deltarl_tp_serve(self, address: str, key: str) -> dict[str, Any]:
        """Start this rank's staging thread on the socket ``{address}.{rank}`` (authentication
        key ``key``, hex) and return its address and the box of each tensor it holds."""
        receiver = self._deltarl_receiver()
        if receiver.views is None or receiver.boxes is None:
            raise RuntimeError("no tensors mapped yet: call init_weight_transfer_engine first")
        old = getattr(self, "_deltarl_shards", None)
        if old is not None:
            old.close()
        rank = int(getattr(self, "rank", 0))
        where = f"{address}.{rank}"
        self._deltarl_shards = ShardServer(
            receiver.views, receiver.device, where, bytes.fromhex(key)
        )
        return {
            "rank": rank,
            "address": where,
            "boxes": {n: b.to_json() for n, b in receiver.boxes.items()},
        }

    def deltarl_tp_apply(self, version: int) -> dict[str, Any]:
        """Write the staged ``version`` into this rank's shards (inside the caller's pause)."""
        server = getattr(self, "_deltarl_shards", None)
        if server is None:
            raise RuntimeError("no staging thread: call deltarl_tp_serve first")
        return server.apply(int(version))
