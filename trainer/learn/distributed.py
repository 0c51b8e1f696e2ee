"""Data-parallel training over several processes (``torchrun``): one replica per rank, DDP.

Roles: **rank 0** alone talks to the coordinator (leases, extensions, acks), publishes versions
and writes metrics and checkpoints; every rank holds a full replica of the fp32 master weights
and the AdamW state. Per step, in this order:

1. rank 0 pulls the step's groups and collates them into one :class:`~deltarl.trainer.learn.batch.TrainBatch`
   (advantages over whole groups, the whole step's loss normaliser);
2. :func:`broadcast` sends it to every rank (a control message: ``("step", batch)``, or
   ``("stop", None)`` / ``("timeout", message)`` / ``("error", message)``, so every rank leaves
   the loop together);
3. each rank trains on its contiguous share of the rows (:func:`shard_rows`), micro-batch by
   micro-batch, as many micro-batches on every rank (:func:`rank_micro_batches`); DDP
   all-reduces the gradients during the last backward (the earlier ones run under
   ``no_sync``). DDP averages over ranks; the loss is multiplied by the world size so the
   gradient is the *sum* over the whole batch, as in one process (exact for power-of-two world
   sizes: scaling by 2^k never rounds);
4. the loss statistics and the per-group on-policy mismatch are gathered (:func:`gather_stats`,
   :func:`sum_over_ranks`) so every rank sees the same metrics and drops the same groups; every rank clips the same global norm and takes the same AdamW
   step, so replicas stay identical;
5. rank 0 publishes from its own replica (its bf16 cast is what every rank holds) and acks.

Equivalence: with 2 ranks and one micro-batch per rank, the reduced gradient is ``g0 + g1``,
the same single addition a 1-rank run with those two micro-batches makes, so the published
weights are bit-identical (tested on CPU with gloo). With more ranks or more micro-batches per
rank the summation order differs (ring all-reduce vs sequential accumulation): equal up to fp32
rounding of the gradient (relative ~1e-7), which the bf16 cast hides for almost every element.

With ``parallel = "fsdp"`` the model is sharded instead (:func:`shard_fsdp`): each rank holds
its rows of the fp32 weights, gradients and AdamW state, FSDP2 all-gathers each layer for its
forward and backward and reduce-scatters the gradients; every rank then publishes its own rows
(:mod:`deltarl.trainer.publish.sharded`), so rank 0 holds no replica to publish from.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import Tensor

from deltarl.trainer.learn.batch import (
    TrainBatch,
    filler,
    micro_batch_spans,
    sequence_lengths,
    split_spans,
)
from deltarl.trainer.learn.loss import LossStats

logger = logging.getLogger(__name__)

__all__ = [
    "DistContext",
    "MicroBatch",
    "broadcast",
    "gather_stats",
    "init_distributed",
    "rank_micro_batches",
    "shard_fsdp",
    "shard_rows",
    "shutdown_distributed",
    "wrap_ddp",
]

#: Names of the module lists whose items are the decoder layers (HF Llama/Qwen: ``layers``,
#: GPT-2: ``h``): each becomes its own FSDP2 unit.
LAYER_LISTS = ("layers", "h", "blocks")


@dataclass(frozen=True, slots=True)
class DistContext:
    """This process's place in the job. ``world_size == 1``: a plain single-process run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that talks to the coordinator and publishes."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> DistContext:
        """From ``torchrun``'s ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (absent: 1 process)."""
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        )


def init_distributed(
    device: str, timeout_s: float = 6 * 3600, init_method: str | None = None
) -> tuple[DistContext, str]:
    """Join the process group when started by ``torchrun`` (``WORLD_SIZE > 1``); return the
    context and the device of this rank.

    ``device``: ``"auto"`` (CUDA if present), ``"cpu"`` or ``"cuda"``: under torchrun each rank
    takes ``cuda:<LOCAL_RANK>``. Backend: NCCL on CUDA, gloo on CPU. ``timeout_s`` bounds every
    collective, including the other ranks' wait while rank 0 waits for data: keep it above the
    longest data wait you accept (``DELTARL_TRAINER_DATA_TIMEOUT_S``). ``init_method``: the
    rendezvous (None: torchrun's ``MASTER_ADDR``/``MASTER_PORT``; tests use ``file://``).
    """
    ctx = DistContext.from_env()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not ctx.enabled:
        return ctx, device
    if device.startswith("cuda"):
        torch.cuda.set_device(ctx.local_rank)
        device = f"cuda:{ctx.local_rank}"
    if not tdist.is_initialized():
        tdist.init_process_group(
            backend="nccl" if device.startswith("cuda") else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            init_method=init_method,
            rank=ctx.rank if init_method else -1,
            world_size=ctx.world_size if init_method else -1,
        )
    logger.info("rank %d of %d on %s", ctx.rank, ctx.world_size, device)
    return ctx, device


def shutdown_distributed(ctx: DistContext, *, clean: bool = True) -> None:
    """Leave the process group. ``clean`` (every rank got here normally): wait for all ranks
    first, so no rank tears down its connections while another still uses them (gloo aborts the
    process then); after a failure, leave at once."""
    if not ctx.enabled or not tdist.is_initialized():
        return
    if clean:
        tdist.barrier()
    tdist.destroy_process_group()


def broadcast(obj: Any, ctx: DistContext) -> Any:
    """``obj`` of rank 0 on every rank (pickled by torch; the objects are our own)."""
    if not ctx.enabled:
        return obj
    box = [obj if ctx.is_main else None]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def _shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``rank``'s contiguous share of ``n`` (sizes differ by at most one)."""
    return n * rank // world_size, n * (rank + 1) // world_size


def shard_rows(batch: TrainBatch, ctx: DistContext) -> TrainBatch:
    """This rank's contiguous share of the rows (sizes differ by at most one)."""
    if not ctx.enabled:
        return batch
    n = len(batch)
    if n < ctx.world_size:
        raise ValueError(
            f"a step of {n} trajectories cannot feed {ctx.world_size} ranks: raise "
            "batch.groups_per_step or batch.group_size"
        )
    return batch.select(slice(*_shard_bounds(n, ctx.rank, ctx.world_size)))


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One forward/backward pass of a rank; a ``filler`` (:func:`~deltarl.trainer.learn.batch.filler`) trains
    nothing and its statistics are dropped."""

    batch: TrainBatch
    filler: bool = False


def rank_micro_batches(
    batch: TrainBatch, ctx: DistContext, size: int, max_tokens: int | None = None
) -> list[MicroBatch]:
    """This rank's micro-batches of its share of ``batch`` (:func:`shard_rows`), as many on
    every rank: FSDP2 runs collectives in every forward and backward, so a rank with fewer
    passes would leave the others waiting.

    Every rank holds the whole batch, so each computes the greedy count
    (:func:`~deltarl.trainer.learn.batch.micro_batch_spans`) of every rank's share and takes the largest, ``K``; its
    own spans are split (:func:`~deltarl.trainer.learn.batch.split_spans`) up to ``K``, and a share of fewer than
    ``K`` rows is completed with fillers. One process: :func:`~deltarl.trainer.learn.batch.micro_batches`.
    """
    shard = shard_rows(batch, ctx)
    lengths = sequence_lengths(batch)
    n, world = len(batch), ctx.world_size
    shares = [lengths[slice(*_shard_bounds(n, r, world))] for r in range(world)]
    greedy = [micro_batch_spans(share, size, max_tokens) for share in shares]
    count = max(len(spans) for spans in greedy)
    spans = split_spans(greedy[ctx.rank], shares[ctx.rank], count)
    parts = [MicroBatch(shard.select(slice(lo, hi))) for lo, hi in spans]
    return parts + [MicroBatch(filler(shard), filler=True)] * (count - len(parts))


def gather_stats(stats: LossStats, ctx: DistContext) -> LossStats:
    """Every rank's statistics merged, on every rank (in rank order, so identically)."""
    if not ctx.enabled:
        return stats
    cpu = LossStats(
        {k: v.cpu() for k, v in stats.sums.items()},
        {k: (s.cpu(), c.cpu()) for k, (s, c) in stats.means.items()},
        {k: v.cpu() for k, v in stats.mins.items()},
        {k: v.cpu() for k, v in stats.maxs.items()},
    )
    parts: list[Any] = [None] * ctx.world_size
    tdist.all_gather_object(parts, cpu)
    merged = LossStats()
    for part in parts:
        merged = merged.merge(part)
    return merged


def sum_over_ranks(t: Tensor, ctx: DistContext) -> Tensor:
    """The element-wise sum of every rank's CPU tensor ``t`` (same shape on every rank), on
    every rank; ``t`` itself with one process."""
    if not ctx.enabled:
        return t
    parts: list[Any] = [None] * ctx.world_size
    tdist.all_gather_object(parts, t.cpu())
    return torch.stack(parts).sum(0)


def wrap_ddp(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """``model`` in :class:`~torch.nn.parallel.DistributedDataParallel` when there are several
    ranks (a collective: every rank calls it at the same point; rank 0's weights and buffers
    are broadcast), else ``model`` itself. A model already sharded by :func:`shard_fsdp` is
    returned as it is."""
    from torch.distributed.fsdp import FSDPModule

    if not ctx.enabled or isinstance(model, FSDPModule):
        return model
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def shard_fsdp(model: torch.nn.Module, ctx: DistContext, device: str) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2 (``fully_shard``): one unit per decoder layer (the
    items of a module list named in :data:`LAYER_LISTS`), then the root (embeddings, final norm,
    head). A collective; every rank must hold the same initial weights (same seed or
    checkpoint). Parameters stay fp32 (bf16 compute comes from the trainer's autocast, as
    without FSDP). Returns ``model``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not ctx.enabled:
        raise ValueError("FSDP needs several ranks: start the trainer with torchrun")
    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (ctx.world_size,))
    units = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in LAYER_LISTS:
            for layer in module:
                fully_shard(layer, mesh=mesh)
                units += 1
    fully_shard(model, mesh=mesh)
    logger.info("FSDP2: %d layer units + root over %d ranks", units, ctx.world_size)
    return model
