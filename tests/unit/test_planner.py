"""Catch-up planning on hand-built manifests (no bucket): chain vs squashed delta vs anchor."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltarl.weightsync.manifest import ObjectRef, VersionManifest, xxh3_hex
from deltarl.weightsync.planner import (
    CatchUpPlan,
    UnreachableVersionError,
    plan_catch_up,
    reachable_versions,
)

_counter = itertools.count()


def digest(v: int) -> str:
    return xxh3_hex(f"state-{v}".encode())


def anchor(v: int, size: int, fmt: str = "safetensors") -> ObjectRef:
    return ObjectRef(
        key=f"objects/v{v:012d}/a{next(_counter)}.bin",
        kind="anchor",
        format=fmt,
        size=size,
        xxh3_128="0" * 32,
        version=v,
        result_digest=digest(v),
    )


def delta(
    base: int, v: int, size: int, fmt: str = "deltarl-compact-v1", context: int | None = None
) -> ObjectRef:
    return ObjectRef(
        key=f"objects/v{v:012d}/d{next(_counter)}.bin",
        kind="delta",
        format=fmt,
        size=size,
        xxh3_128="0" * 32,
        version=v,
        base_version=base,
        base_digest=digest(base),
        result_digest=digest(v),
        changed=1,
        context_version=context,
    )


def build(objects: Iterable[ObjectRef]) -> dict[int, VersionManifest]:
    by_version: dict[int, list[ObjectRef]] = {}
    for o in objects:
        by_version.setdefault(o.version, []).append(o)
    return {
        v: VersionManifest(
            version=v, state_digest=digest(v), numel=10, full_bytes=20, objects=tuple(objs)
        )
        for v, objs in by_version.items()
    }


def hops(plan: CatchUpPlan) -> list[tuple[int | None, int]]:
    return [(s.base_version, s.version) for s in plan.steps]


CHAIN = [anchor(0, 1000), delta(0, 1, 10), delta(1, 2, 10), delta(2, 3, 10)]


def test_delta_chain_beats_anchor() -> None:
    plan = plan_catch_up(build(CHAIN), 0, 3)
    assert hops(plan) == [(0, 1), (1, 2), (2, 3)]
    assert plan.total_bytes == 30 and plan.anchor_chain_bytes == 1030
    assert not plan.uses_anchor and plan.versions == [1, 2, 3]


def test_squashed_delta_when_cheaper() -> None:
    plan = plan_catch_up(build([*CHAIN, delta(0, 3, 25)]), 0, 3)
    assert hops(plan) == [(0, 3)] and plan.total_bytes == 25


def test_chain_when_squashed_is_dearer() -> None:
    plan = plan_catch_up(build([*CHAIN, delta(0, 3, 35)]), 0, 3)
    assert hops(plan) == [(0, 1), (1, 2), (2, 3)]


def test_mixed_chain_and_squashed() -> None:
    objs = [*CHAIN, delta(3, 4, 10), delta(1, 4, 12), delta(0, 2, 50)]
    plan = plan_catch_up(build(objs), 0, 4)
    assert hops(plan) == [(0, 1), (1, 4)] and plan.total_bytes == 22


def test_anchor_plus_chain_beats_a_long_chain() -> None:
    objs = [anchor(0, 100), anchor(50, 100)] + [delta(v - 1, v, 10) for v in range(1, 61)]
    plan = plan_catch_up(build(objs), 0, 60)
    assert plan.steps[0].kind == "anchor" and plan.steps[0].version == 50
    assert plan.total_bytes == 200 and plan.anchor_chain_bytes == 200
    assert plan_catch_up(build(objs), 45, 60).total_bytes == 150  # chain from 45 is cheaper


def test_from_nothing_uses_the_best_anchor() -> None:
    objs = [anchor(0, 100), anchor(2, 100), delta(0, 1, 5), delta(1, 2, 5), delta(2, 3, 5)]
    plan = plan_catch_up(build(objs), None, 3)
    assert hops(plan) == [(None, 2), (2, 3)] and plan.total_bytes == 105
    # An older anchor with a cheaper chain wins when it is cheaper in total.
    objs2 = [anchor(0, 100), anchor(2, 300), delta(0, 1, 5), delta(1, 2, 5), delta(2, 3, 5)]
    assert plan_catch_up(build(objs2), None, 3).total_bytes == 115


def test_cheapest_of_several_anchor_formats() -> None:
    objs = [anchor(0, 100, "safetensors"), anchor(0, 60, "safetensors+zstd")]
    plan = plan_catch_up(build(objs), None, 0)
    assert plan.steps[0].format == "safetensors+zstd"
    only_plain = plan_catch_up(build(objs), None, 0, formats={"safetensors"})
    assert only_plain.steps[0].format == "safetensors" and only_plain.total_bytes == 100


def test_format_filter() -> None:
    objs = [anchor(0, 1000), delta(0, 1, 10), delta(0, 1, 40, fmt="trl-sparse-gap_delta")]
    assert plan_catch_up(build(objs), 0, 1).steps[0].format == "deltarl-compact-v1"
    trl = plan_catch_up(build(objs), 0, 1, formats={"trl-sparse-gap_delta", "safetensors"})
    assert trl.steps[0].format == "trl-sparse-gap_delta" and trl.total_bytes == 40


def test_noop_and_errors() -> None:
    m = build(CHAIN)
    noop = plan_catch_up(m, 3, 3)
    assert noop.steps == () and noop.total_bytes == 0
    with pytest.raises(ValueError, match="not published"):
        plan_catch_up(m, 0, 9)
    with pytest.raises(ValueError, match="current"):
        plan_catch_up(m, -1, 3)
    no_anchor = build([delta(0, 1, 10), delta(1, 2, 10)])
    with pytest.raises(UnreachableVersionError, match="cannot reach version 2 from nothing"):
        plan_catch_up(no_anchor, None, 2)
    with pytest.raises(UnreachableVersionError, match="formats"):
        plan_catch_up(m, 0, 3, formats={"trl-sparse-gap_delta"})


def test_current_without_a_manifest_still_uses_its_deltas() -> None:
    """A replica at a garbage-collected version can still take a delta based on it."""
    m = build([anchor(5, 1000), delta(4, 6, 10), delta(5, 6, 10)])
    assert 4 not in m
    plan = plan_catch_up(m, 4, 6)
    assert hops(plan) == [(4, 6)]


def test_going_back_uses_an_anchor() -> None:
    plan = plan_catch_up(build(CHAIN), 3, 0)
    assert hops(plan) == [(None, 0)]


def test_plan_json_round_trip() -> None:
    plan = plan_catch_up(build([*CHAIN, delta(0, 3, 25)]), None, 3)
    assert CatchUpPlan.model_validate_json(plan.model_dump_json()) == plan


def test_reachable_versions() -> None:
    m = build([anchor(0, 100), delta(0, 1, 10), delta(7, 8, 10)])
    assert reachable_versions(m) == {0, 1}
    assert reachable_versions(m, 7) == {0, 1, 8}


# --- against brute force ----------------------------------------------------------------------


@st.composite
def graphs(draw: st.DrawFn) -> list[ObjectRef]:
    n = draw(st.integers(2, 6))
    objs: list[ObjectRef] = []
    for v in range(n):
        if v == 0 or (draw(st.booleans()) and draw(st.integers(0, 2)) == 0):
            objs.append(anchor(v, draw(st.integers(50, 400))))
        for base in range(v):
            if draw(st.integers(0, 2)) == 0 or (base == v - 1 and draw(st.booleans())):
                objs.append(delta(base, v, draw(st.integers(1, 120))))
    return objs


def brute_force(objs: list[ObjectRef], current: int | None, target: int) -> int | None:
    """Cheapest cost over every sequence of objects (no version visited twice)."""
    best: int | None = None

    def walk(at: int | None, cost: int, seen: frozenset[int | None]) -> None:
        nonlocal best
        if at == target:
            best = cost if best is None else min(best, cost)
            return
        for o in objs:
            usable = o.kind == "anchor" or o.base_version == at
            if usable and o.version not in seen:
                walk(o.version, cost + o.size, seen | {o.version})

    walk(current, 0, frozenset({current}))
    return best


@settings(max_examples=150, deadline=None)
@given(objs=graphs(), data=st.data())
def test_matches_brute_force(objs: list[ObjectRef], data: st.DataObject) -> None:
    manifests = build(objs)
    versions = sorted(manifests)
    target = data.draw(st.sampled_from(versions))
    current = data.draw(st.sampled_from([None, *range(max(versions) + 1)]))
    expected = brute_force(objs, current, target)
    if expected is None:
        with pytest.raises(UnreachableVersionError):
            plan_catch_up(manifests, current, target)
        return
    plan = plan_catch_up(manifests, current, target)
    assert plan.total_bytes == expected == sum(s.size for s in plan.steps)
    at = current
    for i, s in enumerate(plan.steps):  # a valid sequence: anchors anywhere, deltas from `at`
        assert s.kind == "anchor" or s.base_version == at, (i, hops(plan))
        at = s.version
    assert at == target


# --- chained deltas: usable only where the replica holds the context -----------------------

CHAINED = [
    anchor(0, 1000),
    delta(0, 1, 10),
    delta(1, 2, 10),
    delta(1, 2, 8, context=0),
    delta(2, 3, 10),
    delta(2, 3, 8, context=1),
]


def test_chained_deltas_follow_a_delta_from_their_context() -> None:
    plan = plan_catch_up(build(CHAINED), 0, 3)
    assert hops(plan) == [(0, 1), (1, 2), (2, 3)]
    assert [s.context_version for s in plan.steps] == [None, 0, 1] and plan.total_bytes == 26


def test_chained_first_step_needs_the_replicas_context() -> None:
    no_ctx = plan_catch_up(build(CHAINED), 1, 3)  # e.g. loaded v1 from an anchor
    assert [s.context_version for s in no_ctx.steps] == [None, 1] and no_ctx.total_bytes == 18
    ctx = plan_catch_up(build(CHAINED), 1, 3, context=0)  # applied 0 -> 1 last
    assert [s.context_version for s in ctx.steps] == [0, 1] and ctx.total_bytes == 16
    wrong = plan_catch_up(build(CHAINED), 1, 3, context=None)
    assert wrong.steps[0].context_version is None


def test_no_chained_step_after_an_anchor_or_a_squashed_delta() -> None:
    objs = [*CHAINED, anchor(2, 5), delta(0, 2, 12)]
    from_nothing = plan_catch_up(build(objs), None, 3)
    assert hops(from_nothing) == [(None, 2), (2, 3)]
    assert from_nothing.steps[1].context_version is None  # the anchor leaves no context
    squashed = plan_catch_up(build([*CHAINED, delta(0, 2, 11)]), 0, 3)
    # squashed 0 -> 2 (11) + standalone 2 -> 3 (10) = 21 beats the chain 10 + 8 + 8 = 26;
    # the chained 2 -> 3 (context 1) is not usable after the squashed delta
    assert hops(squashed) == [(0, 2), (2, 3)] and squashed.steps[1].context_version is None
    assert squashed.total_bytes == 21


def test_a_cheap_chained_delta_can_make_a_longer_path_win() -> None:
    # 1 -> 3 squashed costs 17; going 1 -> 2 -> 3 costs 10 + 6 (chained) = 16 from context 0
    objs = [*CHAINED[:-1], delta(2, 3, 6, context=1), delta(1, 3, 17)]
    assert plan_catch_up(build(objs), 1, 3, context=0).total_bytes == 14  # 8 + 6
    assert hops(plan_catch_up(build(objs), 1, 3)) == [(1, 2), (2, 3)]  # 10 + 6 = 16 < 17


def test_context_must_be_older_than_current() -> None:
    with pytest.raises(ValueError, match="context"):
        plan_catch_up(build(CHAINED), 1, 3, context=1)
    with pytest.raises(ValueError, match="context"):
        plan_catch_up(build(CHAINED), None, 3, context=0)


def test_object_ref_validates_context_version() -> None:
    with pytest.raises(ValueError, match="context_version"):
        delta(2, 3, 5, context=2)
    with pytest.raises(ValueError, match="context_version"):
        ObjectRef(
            key="objects/v000000000003/x.bin",
            kind="anchor",
            format="safetensors",
            size=1,
            xxh3_128="0" * 32,
            version=3,
            result_digest=digest(3),
            context_version=1,
        )
