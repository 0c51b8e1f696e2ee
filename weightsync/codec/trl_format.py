"""TRL-compatible sparse safetensors deltas (read and write).

TRL's "delta weight sync" (huggingface/trl PRs #5417, #5932, #5937, branches ``delta-weight-sync``
v1-v3; never merged to main) ships each sparse delta as one safetensors file. Its v3 layout, which
:func:`encode_trl` writes, is:

* for every parameter ``name``: ``{name}.idx`` (changed flat C-order positions) and ``{name}.val``
  (the new values at those positions, ``BF16``), both 1-D, in ascending position order;
* index encoding, one per file, named in the metadata key ``encoding``:

  - ``raw``: ``I32`` absolute flat positions (4 bytes per changed element);
  - ``gap_delta``: ``gap[k] = idx[k] - idx[k-1] - 1`` with ``idx[-1] = -1`` (so ``gap[0] =
    idx[0]``), stored as ``U16`` when every gap of that parameter fits in 16 bits and as ``U32``
    for the whole parameter otherwise. The tensor's dtype *is* the width; decoding is
    ``cumsum(gap + 1) - 1``. (TRL also has ``nvcomp_cascaded``, a GPU-only nvCOMP bitstream; it is
    refused here.)

* string metadata (TRL's ``PatchMetadata``): ``format="sparse_weight_patch"``, ``version="1"``,
  ``sparse="True"``, ``model_version`` (the step, decimal), ``num_changed_params`` (parameters in
  the file), ``total_changed_elements``, ``total_elements``, ``sparsity`` (``1 - changed/total``,
  Python ``str(float)``) and ``encoding``. A TRL anchor is the same container with full tensors
  under their own names and ``sparse="False"``: read those with :mod:`.anchor`
  (``require_digests=False``).

TRL's trainer writes only the parameters that changed (an unchanged one is left out of the file).
:func:`encode_trl` writes every parameter, an unchanged one with empty ``.idx``/``.val`` (TRL's
reader applies those as no-ops). When reading, a parameter of ``like`` that is absent from the
file is taken as unchanged. TRL v1 files (``{name}.indices`` ``I32`` + ``{name}.values``, no ``encoding``
key) are read too.

What deltarl adds (extra metadata keys; TRL's reader ignores keys it does not know):

* ``deltarl.format_version`` = ``"1"``; ``deltarl.base_version`` / ``deltarl.version``
  (decimal, ``""`` for ``None``);
* ``deltarl.tensors``: JSON ``{name: {"dtype", "shape", "base", "result"}}`` for every tensor of
  the state (so the file is self-describing: TRL records no shapes), with the per-tensor base and
  result digests that :func:`~.delta.apply_delta` checks;
* ``deltarl.checksum``: xxh3-128 over the other ``deltarl.*`` keys and every stored tensor's name,
  dtype, shape and bytes, so truncation or tampering is a :class:`~.errors.CorruptDeltaError`
  before anything is applied.

Assumptions and deviations (see ``docs/formats.md``):

* TRL casts values to bf16 whatever the parameter's dtype; deltarl stores values in the tensor's
  own dtype (``F16``/``F32`` for fp16/fp32 tensors) so that the round trip stays lossless; for bf16
  models (TRL's only case) the files are identical in layout.
* Positions are int32 in TRL: a tensor of more than 2**31 - 1 elements is refused.
* A plain TRL file (no ``deltarl.*`` keys) carries no digests and no shapes: :func:`decode_trl`
  then needs ``like`` (the base state or its specs), marks every digest
  :data:`~.delta.UNKNOWN_DIGEST` (``Delta.digests_known`` is false, so ``apply_delta`` refuses it
  unless told to apply unchecked) and takes ``version = model_version``,
  ``base_version = model_version - 1`` (TRL's deltas are always against the previous sync).
  :func:`with_local_digests` turns such a delta into a checked one against a local base.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from deltarl.weightsync.anchor import parse_header, tensor_bytes
from deltarl.weightsync.codec.bits import bits_view, dtype_name, float_format, from_bits
from deltarl.weightsync.delta import (
    UNKNOWN_DIGEST,
    Delta,
    TensorPatch,
    check_compatible,
    scatter_patch,
)
from deltarl.weightsync.digest import tensor_digest
from deltarl.weightsync.errors import CorruptDeltaError, DeltaError, StateMismatchError

logger = logging.getLogger(__name__)

IdxEncoding = Literal["raw", "gap_delta"]
IDX_ENCODINGS: tuple[str, ...] = ("raw", "gap_delta")
TRL_FORMAT = "sparse_weight_patch"
FORMAT_VERSION = "1"
INT32_MAX = 2**31 - 1
_SUFFIXES = {".idx": "idx", ".val": "val", ".indices": "idx", ".values": "val"}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Dtype and shape of one tensor, for decoding without the tensors themselves.

    Example::

        TensorSpec(dtype="bfloat16", shape=(576, 1536))
    """

    dtype: str  # "bfloat16" | "float16" | "float32"
    shape: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor | TensorSpec) -> TensorSpec:
        if isinstance(t, TensorSpec):
            return t
        return cls(dtype_name(t.dtype), tuple(t.shape))


# ---------------------------------------------------------------------------------------------
# index codecs


def gap_encode(index: np.ndarray) -> np.ndarray:
    """TRL ``gap_delta``: ``idx[k] - idx[k-1] - 1`` (``idx[-1] = -1``) as uint16, else uint32."""
    if index.size == 0:
        return np.zeros(0, np.uint16)
    gaps = np.diff(index.astype(np.int64), prepend=-1) - 1
    if gaps.min() < 0:
        raise ValueError("indices must be strictly increasing")
    if gaps.max() > 0xFFFFFFFF:
        raise ValueError(f"gap {int(gaps.max())} does not fit in uint32")
    return gaps.astype(np.uint16 if gaps.max() <= 0xFFFF else np.uint32)


def gap_decode(gaps: np.ndarray) -> np.ndarray:
    """Inverse of :func:`gap_encode`: int64 positions ``cumsum(gap + 1) - 1``."""
    return np.cumsum(gaps.astype(np.int64) + 1) - 1


# ---------------------------------------------------------------------------------------------
# checksum over deltarl metadata + payload


def _checksum(meta: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    own = {k: v for k, v in meta.items() if k.startswith("deltarl.") and k != "deltarl.checksum"}
    h.update(json.dumps(own, sort_keys=True, separators=(",", ":")).encode())
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"\n{key}\0{dtype_name(t.dtype)}{list(t.shape)}\0".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def _opt_int(v: int | None) -> str:
    return "" if v is None else str(v)


def _parse_opt_int(s: str, key: str) -> int | None:
    if s == "":
        return None
    try:
        return int(s)
    except ValueError:
        raise CorruptDeltaError(f"metadata {key}={s!r} is not an integer") from None


# ---------------------------------------------------------------------------------------------
# encode


def encode_trl(delta: Delta, idx_encoding: IdxEncoding = "raw") -> bytes:
    """Serialize ``delta`` as a TRL v3 sparse safetensors patch plus deltarl integrity metadata.

    ``idx_encoding``: ``"raw"`` (int32 positions) or ``"gap_delta"`` (uint16 gaps, uint32 per
    parameter when a gap exceeds 65535). Every tensor of the delta is written, unchanged ones
    with empty ``.idx``/``.val``, in name order.
    """
    if idx_encoding not in IDX_ENCODINGS:
        raise ValueError(f"idx_encoding must be one of {IDX_ENCODINGS}, got {idx_encoding!r}")
    if not delta.digests_known:
        raise DeltaError("refusing to write a delta without digests; attach them first")
    tensors: dict[str, torch.Tensor] = {}
    specs: dict[str, dict[str, object]] = {}
    for name in sorted(delta.patches):
        p = delta.patches[name]
        if p.numel > INT32_MAX + 1:
            raise ValueError(
                f"{name}: {p.numel} elements; TRL positions are int32 (at most 2**31 elements)"
            )
        fmt = float_format(p.dtype)
        index = np.asarray(p.index, dtype=np.int64)
        idx = index.astype(np.int32) if idx_encoding == "raw" else gap_encode(index)
        tensors[f"{name}.idx"] = torch.from_numpy(np.ascontiguousarray(idx))
        tensors[f"{name}.val"] = from_bits(p.value, fmt.torch_dtype, (p.changed,))
        specs[name] = {
            "dtype": p.dtype,
            "shape": list(p.shape),
            "base": p.base_digest,
            "result": p.result_digest,
        }
    total, changed = delta.numel, delta.changed
    meta = {
        "format": TRL_FORMAT,
        "version": "1",
        "sparse": "True",
        "model_version": str(delta.version if delta.version is not None else 0),
        "num_changed_params": str(len(delta.patches)),
        "total_changed_elements": str(changed),
        "total_elements": str(total),
        "sparsity": str(1.0 - changed / max(total, 1)),
        "encoding": idx_encoding,
        "deltarl.format_version": FORMAT_VERSION,
        "deltarl.base_version": _opt_int(delta.base_version),
        "deltarl.version": _opt_int(delta.version),
        "deltarl.tensors": json.dumps(specs, separators=(",", ":")),
    }
    meta["deltarl.checksum"] = _checksum(meta, tensors)
    return st_save(tensors, metadata=meta)


# ---------------------------------------------------------------------------------------------
# decode


def trl_metadata(data: bytes) -> dict[str, str]:
    """The string metadata of a safetensors file (header only; validates the header)."""
    meta, _ = _read_header(data)
    return meta


def read_metadata(data: bytes) -> dict[str, str]:
    """The string metadata of a safetensors file (TRL patch or anchor), checked like a header."""
    return _read_header(data)[0]


def _read_header(data: bytes) -> tuple[dict[str, str], list[str]]:
    if len(data) < 8:
        raise CorruptDeltaError(
            f"input is truncated: {len(data)} bytes, not even a safetensors header"
        )
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise CorruptDeltaError(
            f"input is truncated: the safetensors header needs {n} bytes, {len(data) - 8} are left"
        )
    meta, entries = parse_header(data[8 : 8 + n], len(data) - 8 - n)
    return meta, [e.name for e in entries]


def _decode_index(name: str, raw: torch.Tensor, encoding: str, numel: int) -> np.ndarray:
    if raw.dim() != 1:
        raise CorruptDeltaError(f"{name}: index tensor must be 1-D, got shape {list(raw.shape)}")
    if encoding == "raw":
        if raw.dtype not in (torch.int32, torch.int64):
            raise CorruptDeltaError(f"{name}: raw indices must be I32, got {dtype_name(raw.dtype)}")
        index = raw.numpy().astype(np.int64)
    else:
        if raw.dtype not in (torch.uint16, torch.uint32):
            raise CorruptDeltaError(
                f"{name}: gap_delta indices must be U16/U32, got {dtype_name(raw.dtype)}"
            )
        index = gap_decode(raw.numpy())
    if index.size:
        if index[0] < 0 or index[-1] >= numel:
            raise CorruptDeltaError(
                f"{name}: index out of range [0, {numel}) (min {int(index.min())}, max {int(index.max())})"
            )
        if index.size > 1 and not bool(np.all(index[1:] > index[:-1])):
            raise CorruptDeltaError(f"{name}: indices are not strictly increasing")
    return index


def decode_trl(data: bytes, like: Mapping[str, torch.Tensor | TensorSpec] | None = None) -> Delta:
    """Parse a TRL sparse safetensors patch (ours or one written by TRL) into a :class:`Delta`.

    ``like`` names every tensor of the state with its dtype and shape (the base state itself, or
    :class:`TensorSpec` values). It is required for a plain TRL file (which records no shapes);
    with a deltarl-written file it is optional and, if given, must match it
    (:class:`~.errors.StateMismatchError` otherwise). Everything is validated before the delta is
    returned, so nothing is ever written from a bad file: truncation, a bad checksum, malformed
    tensors, indices out of range or not increasing are :class:`~.errors.CorruptDeltaError`.
    """
    meta, _ = _read_header(data)
    if meta.get("sparse") == "False":
        raise CorruptDeltaError(
            "this is a TRL anchor (sparse=False, full tensors), not a sparse delta: read it with "
            "anchor.decode_anchor(data, require_digests=False)"
        )
    if "format" in meta and meta["format"] != TRL_FORMAT:
        raise CorruptDeltaError(
            f"unknown patch format {meta['format']!r} (expected {TRL_FORMAT!r})"
        )
    try:
        tensors = st_load(data)
    except SafetensorError as e:
        raise CorruptDeltaError(f"safetensors refused the input: {e}") from None

    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        for suffix, part in _SUFFIXES.items():
            if key.endswith(suffix):
                groups.setdefault(key[: -len(suffix)], {})[part] = t
                break
        else:
            raise CorruptDeltaError(
                f"unexpected tensor {key!r}: a sparse patch holds only .idx/.val pairs"
            )
    for name, g in groups.items():
        if set(g) != {"idx", "val"}:
            raise CorruptDeltaError(
                f"{name}: needs both an index and a value tensor, has {sorted(g)}"
            )

    ours = "deltarl.format_version" in meta
    digests: dict[str, tuple[str, str]] = {}
    if ours:
        if meta["deltarl.format_version"] != FORMAT_VERSION:
            raise CorruptDeltaError(
                f"unsupported deltarl TRL format version {meta['deltarl.format_version']!r}"
            )
        if meta.get("deltarl.checksum") != _checksum(meta, tensors):
            raise CorruptDeltaError(
                "checksum mismatch: the delta was truncated, modified or corrupted"
            )
        try:
            raw_specs = json.loads(meta["deltarl.tensors"])
            specs = {
                n: TensorSpec(s["dtype"], tuple(int(d) for d in s["shape"]))
                for n, s in raw_specs.items()
            }
            digests = {n: (str(s["base"]), str(s["result"])) for n, s in raw_specs.items()}
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            raise CorruptDeltaError(f"deltarl.tensors metadata is malformed ({e})") from None
        base_version = _parse_opt_int(meta.get("deltarl.base_version", ""), "deltarl.base_version")
        version = _parse_opt_int(meta.get("deltarl.version", ""), "deltarl.version")
        if like is not None:
            _check_like(specs, {n: TensorSpec.of(t) for n, t in like.items()})
    else:
        if like is None:
            raise DeltaError(
                "a plain TRL delta records no tensor shapes: pass like= (the base state or its "
                "TensorSpecs) to decode it"
            )
        specs = {n: TensorSpec.of(t) for n, t in like.items()}
        version = _parse_opt_int(meta.get("model_version", ""), "model_version")
        base_version = version - 1 if version is not None and version > 0 else None
    extra = sorted(set(groups) - set(specs))
    if extra:
        raise StateMismatchError(f"delta patches tensors that the state lacks: {extra[:5]}")

    encoding = meta.get("encoding")
    if encoding is not None and encoding not in IDX_ENCODINGS:
        raise CorruptDeltaError(
            f"unsupported index encoding {encoding!r} (supported: {IDX_ENCODINGS})"
        )

    patches: dict[str, TensorPatch] = {}
    for name in sorted(specs):
        spec = specs[name]
        fmt = float_format(spec.dtype)
        numel = int(np.prod(spec.shape, dtype=np.int64))
        pair = groups.get(name)
        if pair is None:
            index = np.zeros(0, np.int64)
            value = np.zeros(0, fmt.bits_dtype)
        else:
            idx_t, val_t = pair["idx"], pair["val"]
            enc = encoding or ("raw" if idx_t.dtype in (torch.int32, torch.int64) else "gap_delta")
            index = _decode_index(name, idx_t, enc, numel)
            if dtype_name(val_t.dtype) != spec.dtype:
                raise StateMismatchError(
                    f"{name}: values are {dtype_name(val_t.dtype)} but the tensor is {spec.dtype}"
                )
            if val_t.dim() != 1 or val_t.numel() != index.size:
                raise CorruptDeltaError(
                    f"{name}: {index.size} indices but values of shape {list(val_t.shape)}"
                )
            value = bits_view(val_t.contiguous()).numpy()
        base, result = digests.get(name, (UNKNOWN_DIGEST, UNKNOWN_DIGEST))
        patches[name] = TensorPatch(name, spec.dtype, spec.shape, index, value, base, result)
    if not ours:
        logger.info("decoded a plain TRL delta (v%s): no digests, apply only unchecked", version)
    return Delta(base_version=base_version, version=version, patches=patches)


def _check_like(specs: Mapping[str, TensorSpec], like: Mapping[str, TensorSpec]) -> None:
    if set(specs) != set(like):
        missing, extra = sorted(set(specs) - set(like)), sorted(set(like) - set(specs))
        raise StateMismatchError(
            f"state does not match the delta: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    bad = [n for n in sorted(specs) if specs[n] != like[n]]
    if bad:
        n = bad[0]
        raise StateMismatchError(
            f"state does not match the delta: {len(bad)} tensor(s) differ, e.g. {n}: state has "
            f"{like[n].dtype}{list(like[n].shape)}, delta expects {specs[n].dtype}{list(specs[n].shape)}"
        )


def with_local_digests(delta: Delta, base: Mapping[str, torch.Tensor]) -> Delta:
    """Attach digests computed from a local ``base`` to a delta that has none.

    Base digests are those of ``base``; result digests those of ``base`` with the patch applied
    (one tensor copied at a time). The result is a fully checked delta for *this* base: applying
    it elsewhere or twice is refused. It proves nothing about the writer's weights.
    """
    check_compatible(base, delta.patches)
    patches: dict[str, TensorPatch] = {}
    for name, p in delta.patches.items():
        t = base[name]
        patched = t.detach().clone().contiguous()
        scatter_patch(patched, p)
        patches[name] = TensorPatch(
            p.name, p.dtype, p.shape, p.index, p.value, tensor_digest(t), tensor_digest(patched)
        )
    return Delta(base_version=delta.base_version, version=delta.version, patches=patches)
