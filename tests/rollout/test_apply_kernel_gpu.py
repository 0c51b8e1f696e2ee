"""The one-launch store kernel (weightsync/apply_kernel.py) against ``index_copy_`` on
a CUDA GPU with Triton (marked ``gpu``: CI never runs it; vLLM brings Triton).

Run on a GPU machine: ``pytest -m gpu -s tests/rollout/test_apply_kernel_gpu.py``. Random deltas
over many tensors of mixed sizes and all three dtypes, some of them views into fused tensors at
unaligned offsets, are applied once by the kernel and once by ``index_copy_``: both must give
the trainer's bits exactly, and the bytes between the views must stay untouched.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from states import mixed_fused_state, perturb, state_to

from deltarl.weightsync import compute_delta, tensor_digest, verify_result
from deltarl.weightsync.delta import apply_staged, stage_delta

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _needs_triton_on_a_gpu() -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _raw(state: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every distinct underlying tensor (fused bases whole, gaps included) as bytes on the CPU."""
    out = {}
    for t in state.values():
        base = t._base if t._base is not None else t
        out[id(base)] = base.reshape(-1).view(torch.uint8).cpu()
    return out


@pytest.mark.parametrize(("seed", "density"), [(0, 0.001), (1, 0.05), (2, 0.5), (3, 1.0)])
def test_kernel_is_bit_identical_to_index_copy(seed, density):
    old = mixed_fused_state(seed)
    new = perturb(old, density, seed=seed + 10)
    delta = compute_delta(old, new, 0, 1)
    by_kernel, by_copy = state_to(old, "cuda"), state_to(old, "cuda")
    staged = stage_delta(delta, "cuda", by_kernel, kernel="triton")
    assert staged.stores is not None and {v.dtype for _, v in staged.stores} == {
        torch.int16,
        torch.int32,
    }
    assert apply_staged(by_kernel, staged) == "kernel"
    torch.cuda.synchronize()
    staged_copy = stage_delta(delta, "cuda", by_copy, kernel="torch")
    assert staged_copy.stores is None
    assert apply_staged(by_copy, staged_copy) == "index_copy"
    torch.cuda.synchronize()
    raw_k, raw_c = _raw(by_kernel), _raw(by_copy)
    assert len(raw_k) == len(raw_c) == len(old) - 4  # two fused tensors of three views each
    for a, b in zip(raw_k.values(), raw_c.values(), strict=True):
        assert torch.equal(a, b)  # the gaps between fused views included
    want = {n: tensor_digest(t) for n, t in new.items()}
    assert verify_result(by_kernel, delta) == want


def test_kernel_then_index_copy_fallback_on_an_unbound_state():
    old = mixed_fused_state(5)
    new = perturb(old, 0.1, seed=6)
    delta = compute_delta(old, new, 0, 1)
    bound, other = state_to(old, "cuda"), state_to(old, "cuda")
    staged = stage_delta(delta, "cuda", bound)
    assert staged.stores is not None
    # a state the addresses were not built for: index_copy_ into that state, not the bound one
    assert apply_staged(other, staged) == "index_copy"
    torch.cuda.synchronize()
    assert verify_result(other, delta) == {n: tensor_digest(t) for n, t in new.items()}
    assert all(torch.equal(bound[n].cpu(), old[n]) for n in old)


def test_pause_time_smollm2_like():
    """~270 tensors, ~1.7 M changed elements (a SmolLM2-135M delta): the paused work of both
    paths (apply + synchronize), printed for the record; the kernel must not be slower."""
    g = torch.Generator().manual_seed(0)
    sizes = [576 * 576] * 60 + [576 * 192] * 60 + [576 * 1536] * 90 + [576] * 60 + [49152 * 576]
    old = {f"t{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate(sizes)}
    new = perturb(old, 0.013, seed=1)
    delta = compute_delta(old, new, 0, 1)
    times: dict[str, list[float]] = {"kernel": [], "index_copy": []}
    for _ in range(20):
        for mode in ("triton", "torch"):
            state = state_to(old, "cuda")
            staged = stage_delta(delta, "cuda", state, kernel=mode)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            path = apply_staged(state, staged)
            torch.cuda.synchronize()
            times[path].append(time.perf_counter() - t0)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    mx = {k: 1e3 * max(v[1:]) for k, v in times.items()}
    print(
        f"\npaused apply, {len(sizes)} tensors, {delta.changed} changed: kernel p50 "
        f"{med['kernel']:.3f} ms (max {mx['kernel']:.3f}), index_copy_ p50 "
        f"{med['index_copy']:.3f} ms (max {mx['index_copy']:.3f})"
    )
    assert med["kernel"] <= med["index_copy"]
