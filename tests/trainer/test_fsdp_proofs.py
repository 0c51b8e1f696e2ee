"""Weight challenges under FSDP (2 gloo ranks on CPU): the pool of each version is sized by the
coordinator's answer, in collective rounds (rank 0 draws, every rank sends the sampled bytes of
its rows), within ``proof_challenges_max``; the answers are those a worker holding the whole
state computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks
from test_fsdp import join, sharded_bigram
from test_weight_publisher import FakePool

from deltarl.buckets.local import LocalBucket
from deltarl.trainer.learn.distributed import broadcast, shutdown_distributed
from deltarl.trainer.publish import weights as publish_weights
from deltarl.trainer.publish.sharded import ShardedPublisher, local_rows
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync.proof import ProofSpec, proof_answer

TARGETS = (25, 25, 100)  # the pool size the coordinator aims at, per version


def rank_main(rank: int, root: str) -> None:
    ctx, device = join(rank, root)
    model = sharded_bigram(ctx, device)
    # 24-byte chunks: 6 of the 128-byte state, one across the ranks' rows
    publish_weights.PROOF_CHUNK_BYTES = 24
    settings = PublishSettings(proof_challenges=4, proof_chunks=16, proof_challenges_max=40)
    bucket = LocalBucket(Path(root) / "bucket")
    start = model.table.weight.to_local().detach().clone()

    def at(step: int) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            model.table.weight.to_local().copy_(start + 0.25 * step)
        return local_rows(model, ctx)

    if ctx.is_main:
        pool = FakePool(target=TARGETS[0])
        pub = ShardedPublisher(bucket, settings, ctx, challenges=pool)
        for step, target in enumerate(TARGETS):
            pool.target = target
            assert pub.publish(at(step), step=step) == step
        broadcast(("stop", None), ctx)
        full = model.table.weight.full_tensor().to(torch.bfloat16)
        torch.save({"table.weight": full}, Path(root) / "final.pt")
        posts = [(v, len(pairs), pairs) for v, _, pairs in pool.posts]
        (Path(root) / "posts.json").write_text(json.dumps(posts))
    else:
        pub = ShardedPublisher(bucket, settings, ctx)
        while True:
            kind, payload = broadcast(None, ctx)
            if kind == "stop":
                break
            version, step, anchor = payload
            pub.publish_local(at(step), version, step, anchor)
        model.table.weight.full_tensor()  # rank 0 gathers the final weights
    shutdown_distributed(ctx)


@pytest.mark.slow
def test_fsdp_challenge_pools_are_sized_by_the_coordinator(
    tmp_path: Path, one_thread: None
) -> None:
    spawn_ranks(rank_main, tmp_path, 2)
    posts = json.loads((tmp_path / "posts.json").read_text())
    sizes = {v: [n for w, n, _ in posts if w == v] for v in range(len(TARGETS))}
    # v0: 4 first, then what the fleet needs; v1: the fleet's size known, one round;
    # v2: capped at proof_challenges_max
    assert sizes == {0: [4, 21], 1: [25], 2: [25, 15]}
    nonces = [n for _, _, pairs in posts for n, _ in pairs]
    assert len(set(nonces)) == len(nonces)
    final = torch.load(tmp_path / "final.pt")
    spec = ProofSpec(24, 16)
    last = len(TARGETS) - 1
    for v, _, pairs in posts:
        if v == last:
            for nonce, answer in pairs:
                assert proof_answer(final, bytes.fromhex(nonce), last, spec) == answer
