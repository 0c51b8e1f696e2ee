"""Sharded manifests and row views: the rules a worker relies on, refused when broken."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from deltarl.weightsync.delta import Delta, TensorPatch
from deltarl.weightsync.errors import CorruptDeltaError, StateMismatchError
from deltarl.weightsync.manifest import (
    ObjectPart,
    ObjectRef,
    parse_slice_key,
    parts_digest,
    slice_key,
)
from deltarl.weightsync.sharding import layout_view, merge_parts

PREFIX = "objects/v000000000003/"


def part(i: int, slices: tuple[str, ...], size: int = 10) -> ObjectPart:
    return ObjectPart(key=f"{PREFIX}{i:032x}.dlt", size=size, xxh3_128="0" * 32, slices=slices)


def test_slice_keys_round_trip_and_bad_ones_are_refused() -> None:
    assert parse_slice_key(slice_key("a.b[x]", 3, 9)) == ("a.b[x]", 3, 9)
    for bad in ("w", "w[3:3]", "w[5:2]", "w[-1:2]", "w[0:2"):
        with pytest.raises(ValueError, match="not a slice key"):
            parse_slice_key(bad)


def test_a_sharded_ref_must_describe_its_parts() -> None:
    parts = (part(0, ("w[0:2]",)), part(1, ("w[2:4]",), size=7))
    fields = dict(kind="anchor", format="safetensors", version=3, result_digest="a" * 32)
    ref = ObjectRef(key=parts[0].key, size=17, xxh3_128=parts_digest(parts), parts=parts, **fields)
    assert ref.keys == (parts[0].key, parts[1].key) and ref.layout == ("w[0:2]", "w[2:4]")
    with pytest.raises(ValidationError, match="sum of its parts"):
        ObjectRef(key=parts[0].key, size=10, xxh3_128=parts_digest(parts), parts=parts, **fields)
    with pytest.raises(ValidationError, match="first part's key"):
        ObjectRef(key=parts[1].key, size=17, xxh3_128=parts_digest(parts), parts=parts, **fields)
    with pytest.raises(ValidationError, match="parts_digest"):
        ObjectRef(key=parts[0].key, size=17, xxh3_128="1" * 32, parts=parts, **fields)


def test_row_views_write_in_place_and_must_tile_every_tensor() -> None:
    state = {"w": torch.zeros(4, 3), "b": torch.zeros(2)}
    view = layout_view(state, ("w[0:1]", "w[1:4]", "b[0:2]"))
    view["w[1:4]"].fill_(1.0)
    assert state["w"][1:].eq(1).all() and state["w"][0].eq(0).all()
    assert layout_view(state, None) is state
    for layout in (("w[0:1]", "b[0:2]"), ("w[0:2]", "w[1:4]", "b[0:2]"), ("w[0:4]",)):
        with pytest.raises(StateMismatchError, match="does not cover"):
            layout_view(state, layout)
    with pytest.raises(StateMismatchError, match="lacks"):
        layout_view(state, ("w[0:5]", "b[0:2]"))


def patch(name: str) -> TensorPatch:
    idx = np.array([0], np.int64)
    return TensorPatch(name, "float32", (1,), idx, np.array([1], np.int32), "a" * 32, "b" * 32)


def test_parts_merge_only_when_they_cover_the_layout_once() -> None:
    a, b = Delta(1, 2, {"w[0:1]": patch("w[0:1]")}), Delta(1, 2, {"w[1:2]": patch("w[1:2]")})
    assert set(merge_parts([a, b], ("w[0:1]", "w[1:2]")).patches) == {"w[0:1]", "w[1:2]"}
    with pytest.raises(CorruptDeltaError, match="overlap"):
        merge_parts([a, Delta(1, 2, {"w[0:1]": patch("w[0:1]")})], ("w[0:1]",))
    with pytest.raises(CorruptDeltaError, match="do not cover"):
        merge_parts([a], ("w[0:1]", "w[1:2]"))
    with pytest.raises(CorruptDeltaError, match="disagree"):
        merge_parts([a, Delta(0, 2, dict(b.patches))], ("w[0:1]", "w[1:2]"))
