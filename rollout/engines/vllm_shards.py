"""Tensor parallelism for the vllm engine: every rank patches its own shard of each tensor.

With ``tensor_parallel_size > 1`` vLLM (0.33, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) runs its
engine core in the rollout worker's process and one worker process per rank
(``MultiprocExecutor``); each rank's loader narrows every checkpoint tensor to its part
(column-parallel ``qkv``/``gate_up`` and vocabulary-parallel embeddings / LM head: output rows;
row-parallel ``o_proj``/``down_proj``: input columns; norms and, with fewer KV heads than ranks,
``k``/``v`` rows: replicated; stacked MoE experts: every expert's gate and up rows of the rank, a
box of ``[E, 2, I, H]`` (:meth:`Box.fits`), or, under expert parallelism, the rank's whole
experts) and copies that into its fused parameter. The probe
(:func:`~deltarl.rollout.engines.vllm_mapping.probe_views` with ``shards=True``) records, per
rank, the view written and the :class:`Box` of the checkpoint tensor it receives (start and size
per dimension, read off the narrowed source view).

A delta is then sliced per rank on the host (:func:`shard_delta`: the flat Hugging Face indices
inside the rank's box, translated to the box's own C-order flat indices), shipped to the rank
while generation continues and staged on its GPU there (:class:`ShardServer`, a thread in each
vLLM worker process answering a local socket), and applied in one window: the rollout worker
pauses its gate and calls ``collective_rpc("deltarl_tp_apply", version)``, each rank drains its
device, runs ``apply_staged`` on its views and synchronizes. Verification: each rank returns the
digests of its shard views of the changed tensors (again through the socket, off the pause), and
:class:`ShardedWeights` compares them with the same boxes of the host mirror, itself checked
against the trainer's digests: GPU shard == mirror slice == trainer, bit for bit.

Why a socket beside ``collective_rpc``: vLLM's executor is driven by the engine thread (its
message queue and futures are not thread-safe), and every RPC queues behind the forward steps in
flight, so an RPC is only safe, and only cheap, inside the gate's pause. Staging and digests do
not touch vLLM: they run in a thread of the rank's process while vLLM generates. Messages are
JSON headers and safetensors payloads (``multiprocessing.connection`` ``send_bytes`` /
``recv_bytes`` with an authentication key; nothing is unpickled).

No vLLM import here (tests use fakes).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from deltarl.weightsync.codec.bits import float_format
from deltarl.weightsync.delta import (
    UNKNOWN_DIGEST,
    Delta,
    TensorPatch,
    apply_staged,
    stage_delta,
)
from deltarl.weightsync.digest import state_digests, tensor_digest
from deltarl.weightsync.errors import StateMismatchError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Box:
    """The part of a checkpoint tensor of shape ``shape`` that one rank holds: indices
    ``[start[d], start[d] + size[d])`` along every dimension ``d`` (C order inside the box)."""

    shape: tuple[int, ...]
    start: tuple[int, ...]
    size: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.shape) == len(self.start) == len(self.size)):
            raise ValueError(f"box dimensions differ: {self}")
        for n, s, k in zip(self.shape, self.start, self.size, strict=True):
            if s < 0 or k < 0 or s + k > n:
                raise ValueError(f"box {self.start}+{self.size} outside shape {self.shape}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        shape = tuple(int(d) for d in shape)
        return cls(shape, (0,) * len(shape), shape)

    @property
    def is_full(self) -> bool:
        return self.size == self.shape

    def fits(self, shape: Sequence[int]) -> bool:
        """Whether the box is a box of a tensor of ``shape``: its own ``shape`` is ``shape``, or
        a refinement of it (each dimension of ``shape`` split into consecutive box dimensions:
        a stacked ``gate_up`` tensor ``[E, 2I, H]`` seen as ``[E, 2, I, H]``, where one tensor-
        parallel rank's part, its gate rows and its up rows, is one box). Flat indices are the
        same in both shapes, so a box of the refinement slices the tensor's flat indices."""
        if tuple(shape) == self.shape:
            return True
        i = 0
        for n in shape:
            if i == len(self.shape):
                return False
            prod, i = self.shape[i], i + 1
            while prod < n and i < len(self.shape):
                prod, i = prod * self.shape[i], i + 1
            if prod != n:
                return False
        return i == len(self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + k) for s, k in zip(self.start, self.size, strict=True))

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The box of the full tensor ``t`` (a contiguous copy, or ``t`` itself if full; of
        the box's shape, ``size``, when the box is of a refinement of ``t``'s shape)."""
        if tuple(t.shape) != self.shape:
            if not self.fits(t.shape):
                raise ValueError(f"tensor of shape {list(t.shape)} for a box of {list(self.shape)}")
            t = t.reshape(self.shape)
        return t if self.is_full else t[self.slices()].contiguous()

    def localize(self, index: np.ndarray) -> tuple[slice | np.ndarray, np.ndarray]:
        """``(which, local)``: which of the full tensor's sorted flat indices ``index`` fall in
        the box (a slice or a boolean mask over ``index``), and their flat indices inside it
        (C order: increasing where ``index`` increases).

        A box whose dimensions after the first are whole (row blocks: column-parallel and
        vocabulary-parallel tensors) is one contiguous range of flat indices, found by binary
        search; any other box is tested coordinate by coordinate."""
        index = np.asarray(index, dtype=np.int64)
        if self.is_full or not self.shape:
            return slice(None), index
        if self.size[1:] == self.shape[1:]:
            row = math.prod(self.shape[1:])
            lo, hi = self.start[0] * row, (self.start[0] + self.size[0]) * row
            a, b = np.searchsorted(index, [lo, hi])
            return slice(int(a), int(b)), index[a:b] - lo
        coords = np.unravel_index(index, self.shape)
        mask = np.ones(index.shape, dtype=bool)
        for c, s, k in zip(coords, self.start, self.size, strict=True):
            mask &= (c >= s) & (c < s + k)
        local = np.ravel_multi_index(
            tuple(c[mask] - s for c, s in zip(coords, self.start, strict=True)), self.size
        )
        return mask, np.asarray(local, dtype=np.int64)

    def to_json(self) -> dict[str, list[int]]:
        return {"shape": list(self.shape), "start": list(self.start), "size": list(self.size)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Box:
        return cls(*(tuple(int(x) for x in obj[k]) for k in ("shape", "start", "size")))


def box_of(src: torch.Tensor, probe: torch.Tensor) -> Box | None:
    """The box of ``probe`` that ``src`` is, when ``src`` is ``probe`` narrowed along some
    dimensions (same storage, same strides, an offset inside); None otherwise."""
    if src.untyped_storage().data_ptr() != probe.untyped_storage().data_ptr():
        return None
    if src.dim() != probe.dim() or not probe.is_contiguous():
        return None
    shape, size = tuple(probe.shape), tuple(src.shape)
    offset = int(src.storage_offset()) - int(probe.storage_offset())
    if offset < 0 or any(k == 0 for k in size):
        return None
    strides = probe.stride()
    if any(k > 1 and a != b for k, a, b in zip(size, src.stride(), strides, strict=True)):
        return None
    start = tuple(int(c) for c in np.unravel_index(offset, shape)) if shape else ()
    try:
        box = Box(shape, start, size)
    except ValueError:
        return None
    if sum(s * st for s, st in zip(start, strides, strict=True)) != offset:
        return None
    return box


def shard_patch(patch: TensorPatch, box: Box) -> TensorPatch:
    """``patch`` restricted to ``box``, in the box's own flat indices (digests unknown: the
    rank's shard digests are checked against slices of the verified host mirror instead)."""
    if not box.fits(patch.shape):
        raise StateMismatchError(
            f"{patch.name}: the delta's shape {list(patch.shape)}, the rank's box is of "
            f"{list(box.shape)}"
        )
    which, local = box.localize(patch.index)
    return TensorPatch(
        name=patch.name,
        dtype=patch.dtype,
        shape=box.size,
        index=local,
        value=np.asarray(patch.value)[which],
        base_digest=UNKNOWN_DIGEST,
        result_digest=UNKNOWN_DIGEST,
    )


def shard_delta(delta: Delta, boxes: Mapping[str, Box]) -> Delta:
    """The changes of ``delta`` that fall in one rank's ``boxes``, every tensor listed (those
    unchanged in the rank with no changes, as the shared apply code expects)."""
    missing = sorted(set(delta.patches) - set(boxes))
    if missing:
        raise StateMismatchError(f"the delta changes tensors no rank holds: {missing[:5]}")
    patches = {name: shard_patch(p, boxes[name]) for name, p in delta.patches.items()}
    return Delta(delta.base_version, delta.version, patches)


def encode_delta(delta: Delta) -> bytes:
    """A sliced delta as safetensors bytes ("{name}.idx" int64, "{name}.val" bit patterns, for
    changed tensors only), every tensor's shape and dtype in its metadata."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    for name, p in delta.patches.items():
        if p.changed:
            tensors[f"{name}.idx"] = torch.from_numpy(np.ascontiguousarray(p.index, np.int64))
            tensors[f"{name}.val"] = torch.from_numpy(np.ascontiguousarray(p.value))
        meta[name] = {"dtype": p.dtype, "shape": list(p.shape)}
    return st_save(tensors, metadata={"patches": json.dumps(meta)})


def decode_delta(data: bytes, base_version: int | None, version: int | None) -> Delta:
    tensors = st_load(data)
    meta = _metadata(data)
    patches = {}
    for name, m in meta.items():
        dtype = str(m["dtype"])
        empty = np.empty(0, float_format(dtype).bits_dtype)
        patches[name] = TensorPatch(
            name=name,
            dtype=dtype,
            shape=tuple(int(d) for d in m["shape"]),
            index=tensors[f"{name}.idx"].numpy()
            if f"{name}.idx" in tensors
            else empty[:0].astype(np.int64),
            value=tensors[f"{name}.val"].numpy() if f"{name}.val" in tensors else empty,
            base_digest=UNKNOWN_DIGEST,
            result_digest=UNKNOWN_DIGEST,
        )
    return Delta(base_version, version, patches)


def _metadata(data: bytes) -> dict[str, Any]:
    """The ``patches`` entry of a safetensors header (8-byte length, then JSON)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return dict(json.loads(header.get("__metadata__", {}).get("patches", "{}")))


# ---------------------------------------------------------------- rank side (in vLLM's worker)


class ShardServer:
    """One rank's staging thread: answers ``stage`` / ``anchor`` / ``digests`` requests on a
    local socket while vLLM generates; :meth:`apply` (called through ``collective_rpc`` inside
    the rollout worker's pause) writes what was staged."""

    def __init__(
        self, views: Mapping[str, torch.Tensor], device: torch.device, address: str, key: bytes
    ) -> None:
        self.views = dict(views)
        self.device = device
        self._staged: dict[int, tuple[str, Any]] = {}
        self._ready = threading.Condition()
        self._listener = Listener(address, family="AF_UNIX", authkey=key)
        self._thread = threading.Thread(target=self._serve, name="deltarl-shards", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            conn = self._listener.accept()
        except OSError:
            return
        with conn:
            while True:
                try:
                    header = json.loads(conn.recv_bytes())
                    payload = conn.recv_bytes()
                except (EOFError, OSError):
                    return
                try:
                    reply = self._handle(header, payload)
                except Exception as err:  # reported to the rollout worker, which fails the sync
                    logger.exception("deltarl shard request failed")
                    reply = {"error": f"{type(err).__name__}: {err}"}
                conn.send_bytes(json.dumps(reply).encode())

    def _handle(self, header: Mapping[str, Any], payload: bytes) -> dict[str, Any]:
        op = header.get("op")
        t0 = time.perf_counter()
        if op == "stage":
            version = int(header["version"])
            local = decode_delta(payload, header.get("base_version"), version)
            staged = stage_delta(local, self.device, self.views)
            self._put(version, ("delta", staged))
            return {"staged": local.changed, "s": time.perf_counter() - t0}
        if op == "anchor":
            version = int(header["version"])
            state = st_load(payload)
            if set(state) != set(self.views):
                raise StateMismatchError("the anchor's tensors are not this rank's")
            bufs = {n: t.to(self.device, non_blocking=True) for n, t in state.items()}
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._put(version, ("anchor", bufs))
            return {"staged": len(bufs), "s": time.perf_counter() - t0}
        if op == "digests":
            names = list(header["names"])
            if self.device.type == "cuda":
                # a digest reads the weights after the apply (already synchronized), not during
                torch.cuda.synchronize(self.device)
            return {"digests": state_digests({n: self.views[n] for n in names})}
        raise ValueError(f"unknown request {op!r}")

    def _put(self, version: int, item: tuple[str, Any]) -> None:
        with self._ready:
            self._staged = {version: item}  # one staged version at a time
            self._ready.notify_all()

    def apply(self, version: int, timeout: float = 60.0) -> dict[str, Any]:
        """Write the staged ``version`` into the views (drains the device first, synchronizes
        after); returns how it wrote and the seconds."""
        with self._ready:
            if not self._ready.wait_for(lambda: version in self._staged, timeout):
                raise TimeoutError(f"version {version} was never staged on this rank")
            kind, item = self._staged.pop(version)
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # forwards launched before finish first
        t1 = time.perf_counter()
        with torch.no_grad():
            if kind == "delta":
                how = apply_staged(self.views, item)
            else:
                for name, buf in item.items():
                    self.views[name].copy_(buf)
                how = "copy"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"apply": how, "drain_s": t1 - t0, "apply_s": time.perf_counter() - t1}

    def close(self) -> None:
        self._listener.close()


# ---------------------------------------------------------------- rollout worker side


class ShardedWeights:
    """The rollout worker's handle on every rank's shard (see the module docstring).

    ``boxes[r]``: rank ``r``'s box of each checkpoint tensor; ``conns[r]``: its staging
    socket; ``rpc(method, *args)``: vLLM's ``collective_rpc`` (one result per rank, in rank
    order), called only inside the gate's pause.
    """

    def __init__(
        self,
        specs: Mapping[str, tuple[str, tuple[int, ...]]],
        boxes: Sequence[Mapping[str, Box]],
        conns: Sequence[Connection],
        rpc: Callable[..., list[Any]],
    ) -> None:
        if len(boxes) != len(conns) or not boxes:
            raise ValueError("one box map and one connection per rank")
        for r, b in enumerate(boxes):
            if set(b) != set(specs):
                raise StateMismatchError(f"rank {r} maps other tensors than the checkpoint's")
            for name, box in b.items():
                if not box.fits(specs[name][1]):
                    raise StateMismatchError(f"rank {r}: {name} box of another shape")
        _check_covered(specs, boxes)
        self.specs = dict(specs)
        self.boxes = [dict(b) for b in boxes]
        self._conns = list(conns)
        self._rpc = rpc

    @property
    def ranks(self) -> int:
        return len(self.boxes)

    def meta(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors as meta tensors (names, dtypes, shapes)."""
        return {
            n: torch.empty(s, dtype=getattr(torch, d), device="meta")
            for n, (d, s) in self.specs.items()
        }

    def _ask(self, headers: Sequence[Mapping[str, Any]], payloads: Sequence[bytes]) -> list[Any]:
        for conn, h, p in zip(self._conns, headers, payloads, strict=True):
            conn.send_bytes(json.dumps(h).encode())
            conn.send_bytes(p)
        replies = [json.loads(conn.recv_bytes()) for conn in self._conns]
        bad = [f"rank {r}: {x['error']}" for r, x in enumerate(replies) if "error" in x]
        if bad:
            raise RuntimeError(f"deltarl shard request failed: {bad}")
        return replies

    def stage(self, delta: Delta, version: int) -> int:
        """Slice ``delta`` per rank and stage it on every rank's GPU (no pause); returns the
        elements staged over all ranks."""
        payloads = [encode_delta(shard_delta(delta, b)) for b in self.boxes]
        head = {"op": "stage", "version": version, "base_version": delta.base_version}
        replies = self._ask([head] * self.ranks, payloads)
        return sum(int(r["staged"]) for r in replies)

    def stage_anchor(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        payloads = [
            st_save({n: box.take(state[n]).contiguous() for n, box in b.items()})
            for b in self.boxes
        ]
        self._ask([{"op": "anchor", "version": version}] * self.ranks, payloads)

    def apply(self, version: int) -> str:
        """Inside the pause: every rank writes what it staged for ``version``."""
        results = self._rpc("deltarl_tp_apply", version)
        if len(results) != self.ranks:
            raise RuntimeError(f"{len(results)} ranks answered, {self.ranks} expected")
        return str(results[0]["apply"])

    def mismatches(self, names: Sequence[str], mirror: Mapping[str, torch.Tensor]) -> list[str]:
        """``"rank r: name"`` for every shard of ``names`` that does not hash like the same box
        of ``mirror`` (the verified host state); empty: GPU shards == mirror, bit for bit."""
        heads = [{"op": "digests", "names": list(names)}] * self.ranks
        replies = self._ask(heads, [b""] * self.ranks)
        bad = []
        for r, (b, reply) in enumerate(zip(self.boxes, replies, strict=True)):
            got = reply["digests"]
            bad += [
                f"rank {r}: {n}" for n in names if got.get(n) != tensor_digest(b[n].take(mirror[n]))
            ]
        return bad

    def close(self) -> None:
        for conn in self._conns:
            conn.close()


def _check_covered(
    specs: Mapping[str, tuple[str, tuple[int, ...]]], boxes: Sequence[Mapping[str, Box]]
) -> None:
    """Every element of every checkpoint tensor is held by some rank (else part of a tensor
    would never be patched)."""
    for name, (_, shape) in specs.items():
        covered = torch.zeros(tuple(shape), dtype=torch.bool)
        for b in boxes:
            covered.view(b[name].shape)[b[name].slices()] = True
        if math.prod(shape) and not bool(covered.all()):
            raise StateMismatchError(f"{name}: some elements are held by no rank")


def connect(addresses: Sequence[str], key: bytes) -> list[Connection]:
    return [Client(a, family="AF_UNIX", authkey=key) for a in addresses]


def new_key() -> bytes:
    return secrets.token_bytes(32)
