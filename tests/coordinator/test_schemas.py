"""Wire schemas: torch-free import, binary round trip, refusal of malformed payloads."""

from __future__ import annotations

import json
import subprocess
import sys

import msgpack
import pytest
from pydantic import ValidationError

from deltarl.services.coordinator.schemas import (
    TRAJECTORY_FORMAT,
    TRAJECTORY_FORMAT_TEACHER,
    BatchItem,
    BatchLease,
    TeacherLogprobs,
    Trajectory,
    TrajectoryGroup,
    VersionManifest,
    VersionPublish,
    decode_group,
    decode_leased_batch,
    encode_group,
    encode_leased_batch,
    manifest_digest,
)

from .helpers import group, manifest


def test_import_pulls_in_neither_torch_nor_numpy_nor_vllm() -> None:
    code = (
        "import sys; import deltarl.services.coordinator.schemas, deltarl.services.coordinator.client; "
        "bad = [m for m in ('torch', 'numpy', 'vllm', 'fastapi') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_group_round_trip_is_exact_for_float32_values() -> None:
    g = group("k1", vmin=3, vmax=4, n=3)
    data = encode_group(g)
    assert isinstance(data, bytes) and b"deltarl-traj-v1" in data
    assert decode_group(data) == g
    # arrays are raw little-endian bytes, not msgpack numbers
    body = msgpack.unpackb(data)
    assert body["trajectories"][0]["tokens"] == (1).to_bytes(4, "little") + (2).to_bytes(
        4, "little"
    ) + (3).to_bytes(4, "little") + (40000).to_bytes(4, "little")
    assert g.version_min == 3 and g.version_max == 4 and g.num_tokens == 12


def test_logprobs_round_to_float32() -> None:
    g = group("k1")
    g.trajectories[0].logprobs[3] = -0.1
    back = decode_group(encode_group(g))
    assert back.trajectories[0].logprobs[3] == pytest.approx(-0.1, abs=1e-7)
    assert back.trajectories[0].logprobs[3] != -0.1  # float32, documented


def test_sampling_temperature_travels_when_reported() -> None:
    g = group("k1", n=2)
    plain = encode_group(g)
    assert "temperature" not in msgpack.unpackb(plain)["trajectories"][0]  # absent, not null
    assert decode_group(plain).trajectories[0].temperature is None
    g.trajectories[0].temperature = 0.7
    back = decode_group(encode_group(g))
    assert back.trajectories[0].temperature == 0.7 and back.trajectories[1].temperature is None
    for bad in (0.0, -1.0, float("nan"), "hot"):
        body = msgpack.unpackb(plain)
        body["trajectories"][0]["temperature"] = bad
        with pytest.raises(ValueError, match="temperature"):
            decode_group(msgpack.packb(body, use_bin_type=True))


def _mutate(data: bytes, **changes: object) -> bytes:
    body = msgpack.unpackb(data)
    t = body["trajectories"][0]
    for k, v in changes.items():
        if k in t:
            t[k] = v
        else:
            body[k] = v
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "v0"}, "format must be"),
        ({"tokens": b"\x01\x00\x00"}, "not a multiple of 4"),
        ({"tokens": [1, 2, 3, 4]}, "must be msgpack bin"),
        ({"mask": b"\x00\x00\x02\x01"}, "only 0 and 1"),
        ({"logprobs": b"\x00\x00\xc0\x7f" * 4}, "finite"),  # NaN
        ({"logprobs": b"\x00\x00\x80\x3f" * 4}, r"within \[-10000, 0\]"),  # +1.0
        ({"logprobs": b"\xff\xff\x7f\xff" * 4}, r"within \[-10000, 0\]"),  # -3.4e38
        ({"reward": 1e300}, r"within ±1e\+09"),  # finite, but inf in float32
        ({"signals": {"x": 3e9}}, r"signals\['x'\] must be"),
        ({"tokens": b"\xff\xff\xff\xff" * 4}, "negative token id"),
        ({"mask": b"\x00\x01"}, "same length"),
        ({"version_min": 9}, "version_min 9 > version_max"),
        ({"reward": float("inf")}, "finite"),
        ({"idempotency_key": "has space"}, "idempotency_key"),
        ({"extra": 1}, "unknown fields"),
    ],
)
def test_malformed_payloads_are_refused(changes: dict[str, object], message: str) -> None:
    data = _mutate(encode_group(group("k1")), **changes)
    with pytest.raises(ValueError, match=message):
        decode_group(data)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 1e-50, r"temperature must be within \[0.01, 100"),  # 0.0 in float32
        ("temperature", 1e9, r"temperature must be within"),
    ],
)
def test_temperatures_the_trainer_cannot_use_are_refused(
    field: str, value: float, message: str
) -> None:
    body = msgpack.unpackb(encode_group(group("k1")), raw=False)
    body["trajectories"][0][field] = value
    with pytest.raises(ValueError, match=message):
        decode_group(msgpack.packb(body, use_bin_type=True))


def test_garbage_is_refused() -> None:
    with pytest.raises(ValueError, match="not valid msgpack"):
        decode_group(b"\xc1\xc1\xc1")
    with pytest.raises(ValueError, match="msgpack map"):
        decode_group(msgpack.packb([1, 2]))


def test_leased_batch_round_trip() -> None:
    groups = [group("a"), group("b", vmin=2)]
    items = [
        BatchItem(
            submission_id=i,
            worker_id=g.worker_id,
            group_id=g.group_id,
            version_min=g.version_min,
            version_max=g.version_max,
            submitted_at=1.5,
            num_trajectories=len(g.trajectories),
            num_tokens=g.num_tokens,
        )
        for i, g in enumerate(groups)
    ]
    lease = BatchLease(
        batch_id="b1",
        expires_at=2.0,
        items=items,
        dropped_stale=1,
        current_version=3,
        queue_depth=0,
    )
    got = decode_leased_batch(encode_leased_batch(lease, [encode_group(g) for g in groups]))
    assert got.lease == lease and got.groups == groups
    with pytest.raises(ValueError, match="payloads"):
        encode_leased_batch(lease, [])


def test_version_publish_carries_the_bucket_manifest() -> None:
    body = VersionPublish(manifest=manifest(3, anchor=True))
    again = VersionPublish.model_validate_json(body.model_dump_json())
    assert again == body and again.manifest.has_anchor
    with pytest.raises(ValidationError, match="Extra inputs"):
        TrajectoryGroup.model_validate({**group("x").model_dump(), "typo": 1})


def test_manifest_digest_is_of_the_content_not_of_its_json() -> None:
    """What tells a retried publish from a different one: the same manifest in any JSON gives
    the same digest, any change to it another."""
    m = manifest(3, anchor=True)
    d = manifest_digest(m)
    text = json.dumps(m.model_dump(mode="json"), sort_keys=True, indent=2)
    assert len(d) == 64 and manifest_digest(VersionManifest.model_validate_json(text)) == d
    assert manifest_digest(m.model_copy(update={"step": 4})) != d
    moved = m.objects[1].model_copy(update={"size": m.objects[1].size + 1})
    assert manifest_digest(m.model_copy(update={"objects": (m.objects[0], moved)})) != d
    assert manifest_digest(m.model_copy(update={"objects": m.objects[::-1]})) != d  # order counts


def test_every_wire_field_is_documented() -> None:
    import inspect

    from pydantic import BaseModel

    import deltarl.services.coordinator.schemas as schemas

    undocumented = [
        f"{name}.{field}"
        for name in schemas.__all__
        if inspect.isclass(obj := getattr(schemas, name))
        and issubclass(obj, BaseModel)
        and obj.__module__.startswith("deltarl.services.coordinator.schemas")
        for field, info in obj.model_fields.items()
        if not info.description
    ]
    assert undocumented == []


def _with_teacher(k: int = 2) -> TrajectoryGroup:
    traj = Trajectory(
        tokens=[5, 6, 7, 8, 9],
        logprobs=[0.0, 0.0, -1.0, 0.0, -0.25],
        mask=[0, 0, 1, 0, 1],
        prompt_len=2,
        reward=1.0,
        version_min=3,
        version_max=3,
        teacher=TeacherLogprobs(
            k=k,
            temperature=0.7,
            sampled=[-0.5, -2.0],
            ids=list(range(2 * k)),
            logprobs=[-0.5 - i / 8 for i in range(2 * k)],
        ),
    )
    plain = traj.model_copy(update={"teacher": None})
    return TrajectoryGroup(
        idempotency_key="k-t", worker_id="w1", group_id="g", trajectories=[traj, plain]
    )


def test_teacher_logprobs_travel_as_v2() -> None:
    g = _with_teacher()
    payload = encode_group(g)
    assert msgpack.unpackb(payload)["format"] == TRAJECTORY_FORMAT_TEACHER
    assert decode_group(payload) == g  # exact: every value is a float32
    # without teacher data the payload stays v1, readable by older coordinators
    plain = g.model_copy(update={"trajectories": g.trajectories[1:]})
    assert msgpack.unpackb(encode_group(plain))["format"] == TRAJECTORY_FORMAT


def test_bad_teacher_data_is_refused() -> None:
    g = _with_teacher()
    body = msgpack.unpackb(encode_group(g))
    v1 = {**body, "format": TRAJECTORY_FORMAT}
    with pytest.raises(ValueError, match=r"unknown fields \['teacher'\]"):
        decode_group(msgpack.packb(v1))
    t = body["trajectories"][0]["teacher"]
    for change, message in (
        ({"k": 3}, "k=3 entries for each of the 2 positions"),
        ({"k": 0}, "greater than or equal to 1"),
        (
            {"sampled": t["sampled"][:4], "ids": t["ids"][:8], "logprobs": t["logprobs"][:8]},
            "1 positions, but the mask trains on 2",
        ),
        (
            {"logprobs": t["logprobs"][:-4] + b"\x00\x00\x80\x7f"},
            r"finite logprobs within \[-10000, 0\]",
        ),  # +inf
        ({"ids": b"\xff\xff\xff\xff" + t["ids"][4:]}, "negative token id"),
        ({"extra": 1}, "unknown fields"),
    ):
        bad = {**body, "trajectories": [{**body["trajectories"][0], "teacher": {**t, **change}}]}
        with pytest.raises(ValueError, match=message):
            decode_group(msgpack.packb(bad))
    with pytest.raises(ValidationError, match="must hold k=2 entries"):
        TeacherLogprobs(k=2, temperature=1.0, sampled=[-1.0], ids=[1], logprobs=[-1.0])


def test_hints_travel_with_their_positions() -> None:
    g = _with_teacher()
    first = g.trajectories[0]
    hint = TeacherLogprobs(
        k=1, temperature=1.0, sampled=[-0.125], ids=[7], logprobs=[-0.125], positions=[4]
    )
    hinted = first.model_copy(update={"teacher": None, "hint": hint, "hint_text": "E is out"})
    g2 = g.model_copy(update={"trajectories": [Trajectory.model_validate(hinted.model_dump())]})
    payload = encode_group(g2)
    assert msgpack.unpackb(payload)["format"] == TRAJECTORY_FORMAT_TEACHER
    assert decode_group(payload) == g2
    data = hinted.model_dump()
    for positions, message in (
        ([3], "trained positions"),  # mask 0 there
        ([9], "trained positions"),  # beyond the tokens
        (None, "hint.positions is required"),
    ):
        bad = {**data, "hint": {**data["hint"], "positions": positions}}
        with pytest.raises(ValidationError, match=message):
            Trajectory.model_validate(bad)
    with pytest.raises(ValidationError, match="strictly increasing"):
        TeacherLogprobs(
            k=1,
            temperature=1.0,
            sampled=[-1.0, -1.0],
            ids=[1, 2],
            logprobs=[-1.0, -1.0],
            positions=[4, 2],
        )


def test_a_hint_text_needs_its_hint() -> None:
    # it would travel as v1, whose reader refuses hint fields: refused where it is built
    plain = group("k1").trajectories[0].model_dump()
    with pytest.raises(ValidationError, match="hint_text without hint"):
        Trajectory.model_validate(plain | {"hint_text": "the answer has an r"})


def _with_turns() -> TrajectoryGroup:
    t = Trajectory(
        tokens=[5, 6, 7, 8, 9, 10],
        logprobs=[0.0, 0.0, -1.0, 0.0, -0.25, -0.5],
        mask=[0, 0, 1, 0, 1, 1],
        prompt_len=2,
        reward=0.75,
        version_min=3,
        version_max=3,
        turn_ends=[3, 6],
        turn_rewards=[0.25, 0.5],
    )
    return TrajectoryGroup(
        idempotency_key="k-turns", worker_id="w1", group_id="g", trajectories=[t]
    )


def test_per_turn_rewards_travel_in_v1_and_v2() -> None:
    g = _with_turns()
    data = encode_group(g)
    body = msgpack.unpackb(data)
    assert body["format"] == TRAJECTORY_FORMAT
    assert body["trajectories"][0]["turn_rewards"] == bytes(
        __import__("array").array("d", [0.25, 0.5])
    )  # float64, exact
    back = decode_group(data)
    assert back == g and back.trajectories[0].turn_ends == [3, 6]
    plain = decode_group(encode_group(group("k1")))
    assert plain.trajectories[0].turn_ends is None  # absent: not reported
    view = TeacherLogprobs(
        k=1,
        temperature=1.0,
        sampled=[-1.0, -0.25, -0.5],
        ids=[0, 1, 2],
        logprobs=[-1.0, -0.25, -0.5],
    )
    taught = g.model_copy(
        update={"trajectories": [g.trajectories[0].model_copy(update={"teacher": view})]}
    )
    data = encode_group(taught)
    assert msgpack.unpackb(data)["format"] == TRAJECTORY_FORMAT_TEACHER
    assert decode_group(data).trajectories[0].turn_rewards == [0.25, 0.5]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"turn_ends": None}, "give both or neither"),
        ({"turn_ends": [], "turn_rewards": []}, "non-empty"),
        ({"turn_ends": [3], "turn_rewards": [0.25, 0.5]}, "one length"),
        ({"turn_ends": [1, 6]}, r"turn_ends\[0\] = 1 must be at least 2"),
        ({"turn_ends": [4, 3]}, r"turn_ends\[1\] = 3 must be at least 4"),
        ({"turn_ends": [3, 7]}, "at most the 6 tokens"),
        ({"turn_ends": [3, 5]}, "after the last turn's end 5"),
        ({"turn_rewards": [0.25, float("nan")]}, "finite"),
        ({"turn_rewards": [0.25, 0.25]}, "add up to 0.5, not to the episode's reward 0.75"),
    ],
)
def test_bad_per_turn_rewards_are_refused(changes: dict[str, object], message: str) -> None:
    good = _with_turns().trajectories[0].model_dump()
    with pytest.raises(ValidationError, match=message):
        Trajectory.model_validate(good | changes)
    # and on the wire: the same message
    body = msgpack.unpackb(encode_group(_with_turns()))
    raw = body["trajectories"][0]
    for k, v in changes.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = bytes(__import__("array").array("i" if k == "turn_ends" else "d", v))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        decode_group(msgpack.packb(body, use_bin_type=True))
    # a turn that sampled nothing ends where the previous one did
    empty_turn = good | {"turn_ends": [3, 3, 6], "turn_rewards": [0.25, 0.0, 0.5]}
    assert Trajectory.model_validate(empty_turn).turn_ends == [3, 3, 6]
