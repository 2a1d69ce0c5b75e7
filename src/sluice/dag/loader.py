"""Distributed data loading (DistFlow §6.1): each generate worker reads only its own shard.

A ``PromptSource`` is a small picklable description of the dataset (never the rows): every
worker calls ``load(rank, size)`` itself and gets the contiguous region ``[rank·n/size,
(rank+1)·n/size)`` of the ``n`` rows, as DistFlow's loader splits by DP rank. ``ShardLoader``
walks that region epoch after epoch and keeps one cursor per shard, which is what a checkpoint
stores. Nothing here admits prompts; admission credits come from the staleness gate.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sluice.api import PromptItem


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
class PromptFile:
    """A training run's validated prompts as a JSON-lines file (one ``PromptItem`` per line),
    written once by ``write_prompt_file``; each worker parses only its own shard's lines."""

    path: str
    count: int

    def __len__(self) -> int:
        return self.count

    def load(self, rank: int, size: int) -> list[PromptItem]:
        region = shard_range(self.count, rank, size)
        items = []
        with open(self.path, encoding="utf-8") as lines:
            for k, line in enumerate(lines):
                if k >= region.stop:
                    break
                if k >= region.start:
                    row = json.loads(line)
                    items.append(PromptItem(row["index"], row["prompt"], tuple(row["prompt_ids"]), row["fields"]))
        return items


def write_prompt_file(items: Sequence[PromptItem], path: Path) -> PromptFile:
    """The prompts as a ``PromptFile`` at ``path``; a field that JSON cannot hold is an error naming it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        for item in items:
            try:
                fields = json.dumps(item.fields)
            except TypeError as err:
                raise ValueError(f"prompt row {item.index}: its fields cannot be written as JSON ({err})") from None
            head = json.dumps({"index": item.index, "prompt": item.prompt, "prompt_ids": list(item.prompt_ids)})
            out.write(f'{head[:-1]}, "fields": {fields}}}\n')
    return PromptFile(str(path), len(items))


class ShardLoader:
    """One worker's shard of a ``PromptSource``, epoch after epoch; with a ``seed``, each epoch
    in its own order (shuffled by ``(seed, rank, epoch)``), else in file order."""

    def __init__(self, source: PromptSource, rank: int, size: int, seed: int | None = None) -> None:
        self.rank, self.size, self.seed = rank, size, seed
        self.rows = source.load(rank, size)
        if not self.rows:
            raise ValueError(f"prompt shard {rank} of {size} is empty ({len(source)} rows in all)")
        self.position = 0
        self.epoch = 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.seed is not None:
            random.Random((self.seed * 1_000_003 + self.rank) * 1_000_003 + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Any]:
        out = []
        for _ in range(n):
            out.append(self.rows[self._order[self.position]])
            self.position += 1
            if self.position == len(self.rows):
                self.position, self.epoch = 0, self.epoch + 1
                self._order = self._epoch_order()
        return out

    def cursor(self) -> dict[str, int]:
        """This shard's place in the data (a checkpoint keeps one per shard)."""
        return {"rank": self.rank, "size": self.size, "epoch": self.epoch, "position": self.position}

    def restore(self, cursor: dict[str, int]) -> None:
        if (cursor["rank"], cursor["size"]) != (self.rank, self.size):
            raise ValueError(f"cursor of shard {cursor['rank']}/{cursor['size']} given to {self.rank}/{self.size}")
        self.epoch, self.position = cursor["epoch"], cursor["position"]
        self._order = self._epoch_order()
