"""Longest-predicted-first admission for ``LLMProxy`` (StreamRL's LPT dispatch, on the live path).

With a ``LengthPredictor``, requests wait in ``LongestFirstQueue`` instead of in the engines' FIFO
queues: each time a replica has a free slot, the waiting request with the longest predicted
response takes it (ties: arrival order). Long samples therefore start first and the short ones
fill in around them, so the step's last response finishes sooner (Graham's LPT bound instead of
FIFO's). The predictor predicts on arrival and learns from every finished response
(``observe``), online, as the policy's lengths drift.

It knows nothing of replicas: ``release`` asks a ``pick`` callback for a replica with a free slot
(the proxy's routing, which reserves it) and hands it to the head request's waiter.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from sluice.api import LengthPredictor


class LongestFirstQueue:
    """Waiting requests in a heap by predicted response length, longest first."""

    def __init__(self, predictor: LengthPredictor) -> None:
        self.predictor = predictor
        self._heap: list[tuple[float, int, Any, asyncio.Future[Any]]] = []
        self._arrivals = itertools.count()
        self.released = 0
        self.observed = 0

    def predict(self, prompt_ids: Sequence[int], max_new_tokens: int) -> float:
        """Predicted response length of one request, capped at its budget."""
        return min(float(self.predictor.predict([prompt_ids])[0]), float(max_new_tokens))

    def wait(self, predicted: float, item: Any) -> asyncio.Future[Any]:
        """Queue ``item``; the future resolves with the replica ``release`` picks for it."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (-predicted, next(self._arrivals), item, future))
        return future

    def release(self, pick: Callable[[Any], Any | None]) -> None:
        """Give free slots to the longest waiting requests, while ``pick(item)`` finds one
        (``None``: no replica has a free slot now). Cancelled waiters are skipped."""
        while self._heap:
            _, _, item, future = self._heap[0]
            if future.done():
                heapq.heappop(self._heap)
                continue
            target = pick(item)
            if target is None:
                return
            heapq.heappop(self._heap)
            future.set_result(target)
            self.released += 1

    def observe(self, prompt_ids: Sequence[int], length: int) -> None:
        """Learn from a finished response (not from aborted ones: their length is unknown)."""
        self.predictor.observe(prompt_ids, length)
        self.observed += 1

    def __len__(self) -> int:
        return sum(not future.done() for *_, future in self._heap)
