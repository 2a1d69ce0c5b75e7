"""The order training prompts are used in: epochs over the items, each shuffled by seed.

Deterministic from ``(seed, epoch)`` and a position, so a checkpoint stores only the position.
It does not read or validate rows (``data/prompts.py`` does).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from sluice.api import PromptItem


class PromptStream:
    """Cycles through prompts in epochs, each epoch shuffled by ``(seed, epoch)``."""

    def __init__(self, items: Sequence[PromptItem], seed: int) -> None:
        self.items = list(items)
        self.seed = seed
        self.position = 0
        self._epoch = -1
        self._order: list[int] = []

    def take(self, count: int) -> list[PromptItem]:
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.position, len(self.items))
            if epoch != self._epoch:
                self._order = list(range(len(self.items)))
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
                self._epoch = epoch
            out.append(self.items[self._order[offset]])
            self.position += 1
        return out
