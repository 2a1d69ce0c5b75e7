"""A simulated RLVR task for ``SimEngine``: prompts with a per-prompt solve rate, a tokenizer
stand-in, and a reward with latency.

``sim_prompts`` draws, per prompt, whether its group will carry signal: with probability
``signal_fraction`` its solve rate is uniform in [0.2, 0.8] (rewards nearly always mixed), else
0 or 1 (every sample gets the same reward: DAPO's dynamic filter drops the group).
``SimReward`` scores a response 1 with the prompt's solve rate (a stable hash of the response,
so deterministic) after ``latency_s`` simulated seconds on a limited pool of verifier workers. Nothing here
measures anything; benchmarks do.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Sequence
from typing import Any

from sluice.api import PromptItem


class SimTokenizer:
    """Decodes token ids to their decimal spelling (rewards only hash the text); encodes text one
    id per character."""

    eos_token_id = -1

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One id per character (environment observations of ``SimEnv``)."""
        return [ord(ch) for ch in text]


def sim_prompts(count: int, *, signal_fraction: float = 0.5, prompt_len: int = 64, seed: int = 0) -> list[PromptItem]:
    """``count`` distinct prompts of ``prompt_len`` tokens with a ``solve_rate`` field each."""
    if not 0.0 <= signal_fraction <= 1.0:
        raise ValueError(f"signal_fraction must be in [0, 1], got {signal_fraction}")
    rng = random.Random(seed)
    items = []
    for index in range(count):
        ids = (index, *(rng.randrange(32000) for _ in range(prompt_len - 1)))
        rate = rng.uniform(0.2, 0.8) if rng.random() < signal_fraction else float(rng.random() < 0.5)
        items.append(PromptItem(index, f"sim-{index}", ids, {"solve_rate": rate}))
    return items


class SimReward:
    """Reward 1 with probability ``solve_rate`` (hash of the response), after ``latency_s``
    simulated seconds on one of ``workers`` verifier slots (``None``: unlimited)."""

    def __init__(self, latency_s: float = 0.0, *, workers: int | None = None, time_scale: float = 1.0) -> None:
        self.latency_s = latency_s
        self.workers = workers
        self.time_scale = time_scale
        self._slots: asyncio.Semaphore | None = None

    async def __call__(self, response: str, **fields: Any) -> float:
        solve_rate = float(fields["solve_rate"])  # a KeyError names a row without the field
        if self.latency_s > 0:
            if self.workers is None:
                await asyncio.sleep(self.latency_s * self.time_scale)
            else:
                self._slots = self._slots or asyncio.Semaphore(self.workers)
                async with self._slots:
                    await asyncio.sleep(self.latency_s * self.time_scale)
        digest = hashlib.blake2b(response.encode(), digest_size=8).digest()
        return float(int.from_bytes(digest, "little") / 2**64 < solve_rate)
