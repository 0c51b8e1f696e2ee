"""The in-memory delta: compute, apply in place, integrity checks, composition."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from states import perturb

from deltarl.weightsync import (
    BaseMismatchError,
    StateMismatchError,
    VerificationError,
    apply_delta,
    compose,
    compute_delta,
    state_digest,
    tensor_digest,
)


def clone(state):
    return {k: v.clone() for k, v in state.items()}


def bits_equal(a, b) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


def test_apply_reproduces_new_state_bit_exactly(state):
    new = perturb(state, 0.05)
    d = compute_delta(state, new, 3, 4)
    assert 0 < d.density < 0.2
    s = clone(state)
    apply_delta(s, d)
    assert bits_equal(s, new)
    assert d.result_digest == state_digest(new) and d.base_digest == state_digest(state)


def test_apply_twice_is_refused_before_writing(state):
    new = perturb(state, 0.05)
    d = compute_delta(state, new, 0, 1)
    s = clone(state)
    apply_delta(s, d)
    before = clone(s)
    with pytest.raises(BaseMismatchError, match="applied twice"):
        apply_delta(s, d)
    assert bits_equal(s, before)


def test_wrong_base_refused_and_nothing_written(state):
    other = perturb(state, 0.01, seed=9)
    d = compute_delta(state, perturb(state, 0.05), 0, 1)
    s = clone(other)
    with pytest.raises(BaseMismatchError, match="nothing was written"):
        apply_delta(s, d)
    assert bits_equal(s, other)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.pop("head.bias"), "removed"),
        (lambda s: s.__setitem__("extra", torch.zeros(3, dtype=torch.bfloat16)), "added"),
    ],
)
def test_added_or_removed_tensors_are_an_error(state, mutate, message):
    new = clone(state)
    mutate(new)
    with pytest.raises(StateMismatchError, match=message):
        compute_delta(state, new)


def test_reshaped_or_cast_tensor_is_an_error(state):
    new = clone(state)
    new["embed.weight"] = new["embed.weight"].reshape(48, 64).contiguous()
    with pytest.raises(StateMismatchError, match="became"):
        compute_delta(state, new)
    new = clone(state)
    new["head.bias"] = new["head.bias"].float()
    with pytest.raises(StateMismatchError, match="became"):
        compute_delta(state, new)


def test_apply_to_state_with_different_shapes_refused(state):
    d = compute_delta(state, perturb(state, 0.05))
    s = clone(state)
    s["embed.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    with pytest.raises(StateMismatchError, match=r"embed\.weight"):
        apply_delta(s, d)


def test_verification_catches_a_tampered_patch(state):
    new = perturb(state, 0.05)
    d = compute_delta(state, new)
    name = "layer.0.proj.weight"
    d.patches[name].value = d.patches[name].value.copy()
    d.patches[name].value[0] ^= 1
    s = clone(state)
    with pytest.raises(VerificationError, match="poisoned"):
        apply_delta(s, d)


def test_compose_equals_sequential_apply(state):
    states = [state]
    for i in range(4):
        states.append(perturb(states[-1], 0.03, seed=10 + i))
    deltas = [compute_delta(a, b, i, i + 1) for i, (a, b) in enumerate(itertools.pairwise(states))]
    squashed = compose(deltas)
    assert (squashed.base_version, squashed.version) == (0, 4)
    s = clone(state)
    apply_delta(s, squashed)
    assert bits_equal(s, states[-1])
    assert squashed.changed <= sum(d.changed for d in deltas)


def test_compose_refuses_a_broken_chain(state):
    a = perturb(state, 0.03, seed=1)
    b = perturb(state, 0.03, seed=2)
    with pytest.raises(BaseMismatchError, match="do not chain"):
        compose([compute_delta(state, a, 0, 1), compute_delta(b, perturb(b, 0.02), 1, 2)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_special_bit_patterns_round_trip(dtype):
    specials = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-30, -2.5], dtype=torch.float32
    ).to(dtype)
    old = {"w": specials.clone()}
    new_bits = specials.clone().view(torch.int16 if dtype != torch.float32 else torch.int32)
    new_bits[0] += 1  # a different NaN payload
    new_bits[3] = 0  # -0.0 -> +0.0
    new = {"w": new_bits.view(dtype)}
    d = compute_delta(old, new)
    assert d.changed == 2
    s = clone(old)
    apply_delta(s, d)
    assert bits_equal(s, new)


def test_digest_distinguishes_shape_and_dtype():
    t = torch.arange(6, dtype=torch.bfloat16)
    assert tensor_digest(t) != tensor_digest(t.reshape(2, 3))
    assert tensor_digest(t) != tensor_digest(t.view(torch.float16))
    assert tensor_digest(t) == tensor_digest(t.clone())


def test_indices_are_sorted_int64(state):
    d = compute_delta(state, perturb(state, 0.3))
    for p in d.patches.values():
        assert p.index.dtype == np.int64
        assert np.all(np.diff(p.index) > 0)


@pytest.mark.parametrize("bind", [False, True])
def test_staged_apply_is_bit_exact(state, bind):
    from deltarl.weightsync import apply_staged, stage_delta, verify_result

    new = perturb(state, 0.05)
    d = compute_delta(state, new, 0, 1)
    s = clone(state)
    staged = stage_delta(d, "cpu", s if bind else None)
    apply_staged(s, staged)
    assert bits_equal(s, new)
    assert verify_result(s, d) == {k: tensor_digest(v) for k, v in new.items()}


def test_batched_staging_views_match_each_patch(state):
    """The CUDA path's layout (one index buffer, one value buffer per bit width), run on CPU:
    every part is exactly its patch, in order, across mixed dtypes."""
    from deltarl.weightsync.delta import _stage_batched, iter_changed_tensors

    mixed = dict(state) | {"fp32.extra": torch.randn(33, 7)}
    new = perturb(mixed, 0.05)
    new["fp32.extra"] = mixed["fp32.extra"] + (torch.rand(33, 7) < 0.2) * 1e-3
    d = compute_delta(mixed, new, 0, 1)
    patches = list(iter_changed_tensors(d))
    assert {p.value.dtype for p in patches} == {np.dtype(np.int16), np.dtype(np.int32)}
    parts, groups = _stage_batched(patches, torch.device("cpu"), pin=False)
    # grouped by bit width (first seen first), in the patches' order within a width
    widths = list(dict.fromkeys(p.value.dtype for p in patches))
    ordered = [p for w in widths for p in patches if p.value.dtype == w]
    assert [name for name, _, _ in parts] == [p.name for p in ordered]
    for (_, idx, val), p in zip(parts, ordered, strict=True):
        assert np.array_equal(idx.numpy(), p.index) and np.array_equal(val.numpy(), p.value)
    assert [g.values.dtype for g in groups] == [torch.int16, torch.int32]
    for g in groups:  # each width's index slice is aligned with its value buffer
        assert g.index.numel() == g.values.numel() == sum(g.counts)
        assert torch.equal(g.index, torch.cat([parts[i][1] for i in range(g.first, g.end)]))
        assert torch.equal(g.values, torch.cat([parts[i][2] for i in range(g.first, g.end)]))
    s = clone(mixed)
    from deltarl.weightsync.delta import StagedDelta, apply_staged

    apply_staged(s, StagedDelta(delta=d, device=torch.device("cpu"), parts=parts))
    assert bits_equal(s, new)


def test_staged_apply_refuses_a_different_state(state):
    from deltarl.weightsync import apply_staged, stage_delta

    d = compute_delta(state, perturb(state, 0.05), 0, 1)
    staged = stage_delta(d, "cpu", clone(state))
    other = clone(state)
    other["embed.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    with pytest.raises(StateMismatchError):
        apply_staged(other, staged)
