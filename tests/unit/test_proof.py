"""Weight proofs (weightsync/proof.py): the sampled answer equals a plain reference
computed on the concatenated bytes, and any change a sampled chunk covers changes it."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from deltarl.weightsync.proof import (
    MAGIC,
    ProofError,
    ProofSpec,
    chunk_numbers,
    make_challenges,
    new_nonce,
    proof_answer,
)


def reference(state: dict[str, torch.Tensor], nonce: bytes, version: int, spec: ProofSpec) -> str:
    """The format of the module docstring, written the obvious way."""
    names = sorted(state)
    blob = b"".join(state[n].contiguous().view(torch.uint8).numpy().tobytes() for n in names)
    h = hashlib.blake2b(key=nonce, digest_size=32)
    h.update(MAGIC + struct.pack("<QIIQ", version, spec.chunk_bytes, spec.chunks, len(blob)))
    for n in names:
        shape = ",".join(str(d) for d in state[n].shape)
        h.update(f"{n}\0{state[n].dtype}\0{shape}\n".encode())
    cb = spec.chunk_bytes
    if spec.chunks == 0:
        h.update(blob)
        return h.hexdigest()
    for c in chunk_numbers(nonce, -(-len(blob) // cb), spec.chunks):
        h.update(struct.pack("<Q", c * cb) + blob[c * cb : (c + 1) * cb])
    return h.hexdigest()


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "b.weight": torch.randn(33, 7, generator=g).to(torch.bfloat16),  # 462 bytes: odd sizes
        "a.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.empty": torch.zeros(0, dtype=torch.bfloat16),
        "d.scale": torch.randn(3, 3, generator=g),  # float32 next to bf16
        "e.t": torch.randn(8, 4, generator=g).to(torch.bfloat16).t(),  # not contiguous
    }


@pytest.mark.parametrize(
    "spec", [ProofSpec(64, 50), ProofSpec(100, 7), ProofSpec(1, 300), ProofSpec(64, 0)]
)
def test_answer_matches_the_reference(spec: ProofSpec) -> None:
    s = state()
    for _ in range(5):
        nonce = new_nonce()
        assert proof_answer(s, nonce, 3, spec) == reference(s, nonce, 3, spec)


def test_chunks_cross_tensor_boundaries() -> None:
    s = state()
    # 64-byte chunks over tensors of 10, 462, 36 (+ 0) bytes: many chunks span two tensors
    spec = ProofSpec(64, 2000)  # with replacement: every chunk is drawn
    nonce = new_nonce()
    assert proof_answer(s, nonce, 1, spec) == reference(s, nonce, 1, spec)


def test_any_difference_in_a_sampled_chunk_changes_the_answer() -> None:
    s, nonce, spec = state(), new_nonce(), ProofSpec(16, 4000)
    base = proof_answer(s, nonce, 1, spec)
    flipped = {k: v.clone() for k, v in s.items()}
    flipped["b.weight"].view(torch.int16)[17, 3] ^= 1  # one bit
    assert proof_answer(flipped, nonce, 1, spec) != base
    assert proof_answer(s, nonce, 2, spec) != base  # bound to the version
    assert proof_answer(s, new_nonce(), 1, spec) != base  # and to the nonce
    renamed = {("z" if k == "a.bias" else k): v for k, v in s.items()}
    assert proof_answer(renamed, nonce, 1, spec) != base  # and to the layout
    assert proof_answer(state(1), nonce, 1, spec) != base


def test_challenges_are_fresh_and_checkable() -> None:
    s, spec = state(), ProofSpec()
    pairs = make_challenges(s, 5, spec, 4)
    assert len({n for n, _ in pairs}) == 4
    for nonce, answer in pairs:
        assert proof_answer(s, bytes.fromhex(nonce), 5, spec) == answer


def test_bad_input() -> None:
    with pytest.raises(ProofError, match="nonce"):
        proof_answer(state(), b"short", 1, ProofSpec())
    with pytest.raises(ProofError, match="empty"):
        proof_answer({}, new_nonce(), 1, ProofSpec())
    with pytest.raises(ProofError, match="zero bytes"):
        proof_answer({"x": torch.zeros(0)}, new_nonce(), 1, ProofSpec())
    with pytest.raises(ProofError, match="chunk_bytes"):
        ProofSpec(0, 1)
    with pytest.raises(ProofError, match="chunks"):
        ProofSpec(64, -1)
