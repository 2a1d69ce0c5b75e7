"""Distributed data loading (DistFlow §6.1): each generate worker reads only its own shard.

A ``PromptSource`` is a small picklable description of the dataset (never the rows): every
worker calls ``load(rank, size)`` itself and gets the contiguous region ``[rank·n/size,
(rank+1)·n/size)`` of the ``n`` rows, as DistFlow's loader splits by DP rank. ``ShardLoader``
walks that region epoch after epoch and keeps one cursor per shard, which is what a checkpoint
stores. Nothing here admits prompts; admission credits come from the staleness gate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class PromptSource(Protocol):
    def __len__(self) -> int: ...

    def load(self, rank: int, size: int) -> Sequence[Any]:
        """Rows of shard ``rank`` of ``size`` (its contiguous region)."""
        ...


def shard_range(n: int, rank: int, size: int) -> range:
    """The contiguous region of shard ``rank``: sizes differ by at most one row."""
    if not 0 <= rank < size:
        raise ValueError(f"shard rank {rank} of {size}")
    return range(rank * n // size, (rank + 1) * n // size)


@dataclass(frozen=True)
class IndexPrompts:
    """``count`` prompts that are their own indices (the data-path benchmark and tests)."""

    count: int

    def __len__(self) -> int:
        return self.count

    def load(self, rank: int, size: int) -> list[int]:
        return list(shard_range(self.count, rank, size))


class ShardLoader:
    """One worker's shard of a ``PromptSource``, in order, epoch after epoch."""

    def __init__(self, source: PromptSource, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.rows = source.load(rank, size)
        if not self.rows:
            raise ValueError(f"prompt shard {rank} of {size} is empty ({len(source)} rows in all)")
        self.position = 0
        self.epoch = 0

    def take(self, n: int) -> list[Any]:
        out = []
        for _ in range(n):
            out.append(self.rows[self.position])
            self.position += 1
            if self.position == len(self.rows):
                self.position, self.epoch = 0, self.epoch + 1
        return out

    def cursor(self) -> dict[str, int]:
        """This shard's place in the data (a checkpoint keeps one per shard)."""
        return {"rank": self.rank, "size": self.size, "epoch": self.epoch, "position": self.position}

    def restore(self, cursor: dict[str, int]) -> None:
        if (cursor["rank"], cursor["size"]) != (self.rank, self.size):
            raise ValueError(f"cursor of shard {cursor['rank']}/{cursor['size']} given to {self.rank}/{self.size}")
        self.epoch, self.position = cursor["epoch"], cursor["position"]
