"""``GuessNumberEnv``: a multi-step game — find a hidden number from higher / lower hints.

The first observation is the range, ``lo-hi`` (15 numbers). The model guesses with ``g<n>``; the
env answers ``h`` (the number is higher), ``l`` (lower) or ends the episode with reward 1 when the
guess is right. A malformed guess is answered ``x``. Binary search always wins within 4 guesses;
guessing at random rarely does, so the policy has to use the hints of earlier turns. The episode
ends without reward when the runner's turn limit is reached.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from sluice.api import EnvStep

SPAN = 15


def secret(seed: int) -> tuple[int, int]:
    """(lowest number of the range, hidden number) of episode ``seed``."""
    rng = random.Random(seed)
    lo = rng.randint(0, 20)
    return lo, rng.randint(lo, lo + SPAN - 1)


class GuessNumberEnv:
    """See the module docstring. Reset options ``lo`` and ``target`` fix the game; else ``seed`` does."""

    def __init__(self) -> None:
        self.lo = self.target = 0
        self.guesses = 0

    async def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> str:
        options = options or {}
        self.lo, self.target = (int(options["lo"]), int(options["target"])) if "target" in options else secret(seed)
        self.guesses = 0
        return f"{self.lo}-{self.lo + SPAN - 1}"

    async def step(self, action: str) -> EnvStep:
        self.guesses += 1
        if not (action.startswith("g") and action[1:].isdigit()):
            return EnvStep("x", 0.0, False, {"guesses": self.guesses})
        guess = int(action[1:])
        if guess == self.target:
            return EnvStep("", 1.0, True, {"guesses": self.guesses})
        return EnvStep("h" if self.target > guess else "l", 0.0, False, {"guesses": self.guesses})

    async def close(self) -> None:
        return None
