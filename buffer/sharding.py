"""How one update's training rows are cut into mini-batches and shared by a learner group.

The update (learner/update.py) trains B rows in mini-batches ("chunks") of train.batch_size, in
the order of one permutation drawn from a generator keyed by (run seed, policy version). With N
learners, every chunk is split into N near-equal contiguous slices, one per rank; each rank
backpropagates its slice and the group all-reduces the gradient, so the group's step is the
single learner's step on the same chunk. The chunks are fixed for the whole update (inner epochs
re-order them), so a rank trains the same rows throughout and the buffer can send each rank only
its own rows. Everything here is a pure function of (B, batch size, N, key): the buffer and every
rank compute the same plan without talking to each other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def update_generator(seed: int, version: int) -> torch.Generator:
    """The update's random stream: row order, chunk order, timestep draws. Keyed, so reproducible
    with nothing to checkpoint."""
    return torch.Generator().manual_seed(seed * 1_000_003 + version)


def update_chunks(num_rows: int, batch_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    """The update's mini-batches: one permutation of the rows, cut into batch_size pieces (the last
    may be shorter). Draws exactly one randperm from `gen`."""
    return list(torch.randperm(num_rows, generator=gen).split(batch_size))


def chunk_share(chunk: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's contiguous slice of a chunk; sizes differ by at most one (like numpy.array_split)."""
    n = len(chunk)
    lo, hi = rank * n // world, (rank + 1) * n // world
    return chunk[lo:hi]


def rank_rows(chunks: list[torch.Tensor], rank: int, world: int) -> torch.Tensor:
    """Every row the rank trains in this update, sorted."""
    return torch.cat([chunk_share(c, rank, world) for c in chunks]).sort().values


@dataclass
class Shard:
    """What a rank needs besides its rows: where they sit in the whole batch, how big it is, and
    the key the plan was made with (the learner checks it against its own version)."""

    row_ids: torch.Tensor  # [b_r] global row index of each local row, sorted
    num_rows: int  # B, the whole update's rows
    rank: int = 0
    world: int = 1
    key: tuple[int, int] | None = None  # (seed, version) the plan was drawn with; None: a single learner's whole batch

    @classmethod
    def whole(cls, num_rows: int) -> "Shard":
        return cls(torch.arange(num_rows), num_rows)


def shard_batch(batch, batch_size: int, world: int, seed: int, version: int) -> list[tuple[object, Shard]]:
    """[(rows of rank r, its Shard)] for r < world, by the plan every rank will redraw."""
    chunks = update_chunks(len(batch), batch_size, update_generator(seed, version))
    out = []
    for r in range(world):
        rows = rank_rows(chunks, r, world)
        out.append((batch.select(rows), Shard(rows, len(batch), r, world, (seed, version))))
    return out
