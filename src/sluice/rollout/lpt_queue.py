"""Longest-predicted-first admission for ``LLMProxy`` (StreamRL's LPT dispatch, on the live path).

With a ``LengthPredictor``, requests wait in ``LongestFirstQueue`` instead of in the engines' FIFO
queues: each time a replica has a free slot, the waiting request with the longest predicted
response takes it (ties: arrival order). Long samples therefore start first and the short ones
fill in around them, so the step's last response finishes sooner (Graham's LPT bound instead of
FIFO's). The predictor predicts on arrival and learns from every finished response
(``observe``), online, as the policy's lengths drift.

With skewness-aware dispatch the proxy also gives the queue a ``lane`` function (long tail or
regular, ``skew_dispatch.LongTailSplit``): each lane is its own longest-first heap over its own
replicas, so the long tail waiting for a dedicated replica never holds up the regular requests.

It knows nothing of replicas: ``release`` asks a ``pick`` callback for a replica with a free slot
(the proxy's routing, which reserves it) and hands it to the head request's waiter.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from sluice.api import LengthPredictor

_Entry = tuple[float, int, Any, "asyncio.Future[Any]"]  # (-predicted, arrival, item, its turn)


class LongestFirstQueue:
    """Waiting requests in heaps by predicted response length, longest first.

    ``lane`` (optional) sorts each request into a lane when it is first considered for release
    (skewness-aware dispatch: long tail or regular), after everything that arrived in the same
    event-loop iteration, so a wave of requests is classified together. Lanes use disjoint
    replicas: a lane without a free slot holds only its own requests.
    """

    def __init__(self, predictor: LengthPredictor, lane: Callable[[Any], Hashable] | None = None) -> None:
        self.predictor = predictor
        self.lane = lane
        self._arrived: list[_Entry] = []
        self._lanes: dict[Hashable, list[_Entry]] = {}
        self._arrivals = itertools.count()
        self.released = 0
        self.observed = 0

    def predict(self, prompt_ids: Sequence[int], max_new_tokens: int) -> float:
        """Predicted response length of one request, capped at its budget."""
        return min(float(self.predictor.predict([prompt_ids])[0]), float(max_new_tokens))

    def wait(self, predicted: float, item: Any) -> asyncio.Future[Any]:
        """Queue ``item``; the future resolves with the replica ``release`` picks for it."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._arrived.append((-predicted, next(self._arrivals), item, future))
        return future

    def release(self, pick: Callable[[Any], Any | None]) -> None:
        """Give free slots to the longest waiting requests, while ``pick(item)`` finds one
        (``None``: no replica has a free slot for it now; that closes the item's lane until the
        next call). Across lanes the longest head goes first. Cancelled waiters are skipped."""
        for entry in self._arrived:
            key = self.lane(entry[2]) if self.lane is not None else None
            heapq.heappush(self._lanes.setdefault(key, []), entry)
        self._arrived.clear()
        open_lanes = {key: heap for key, heap in self._lanes.items() if heap}
        while open_lanes:
            key = min(open_lanes, key=lambda k: open_lanes[k][0][:2])
            heap = open_lanes[key]
            _, _, item, future = heap[0]
            if not future.done():
                target = pick(item)
                if target is None:  # no free slot for this lane now
                    del open_lanes[key]
                    continue
                future.set_result(target)
                self.released += 1
            heapq.heappop(heap)
            if not heap:
                del open_lanes[key]

    def fail(self, error: BaseException) -> None:
        """End every waiting request with ``error`` (no replica will ever take them)."""
        for _, _, _, future in [*self._arrived, *(entry for heap in self._lanes.values() for entry in heap)]:
            if not future.done():
                future.set_exception(error)
        self._arrived.clear()
        self._lanes.clear()

    def observe(self, prompt_ids: Sequence[int], length: int) -> None:
        """Learn from a finished response (not from aborted ones: their length is unknown)."""
        self.predictor.observe(prompt_ids, length)
        self.observed += 1

    def __len__(self) -> int:
        waiting = itertools.chain(self._arrived, *self._lanes.values())
        return sum(not future.done() for *_, future in waiting)
