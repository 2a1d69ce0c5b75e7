"""``SlotDispatch``: ``LLMProxy``'s longest-predicted-first admission over replica slots (StreamRL),
with optional skewness-aware dispatch.

Requests wait in a ``LongestFirstQueue``; each free slot (``slots`` running requests per replica,
a smaller cap on a ``LongTailSplit``'s long-tail replicas) goes to the waiting request with the
longest predicted response, on its lane's side when a split divides the replicas. Requests that
arrive together are ranked together (the release runs on the next loop iteration).

It does not run requests or talk to replicas: the proxy owns the replica states (shared here by
reference; only their ``reserved`` slot counts change here) and runs what this releases.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from sluice.api import GenerationRequest, LengthPredictor
from sluice.rollout.lpt_queue import LongestFirstQueue
from sluice.rollout.routing import AffinityRouter, Flight, ReplicaState
from sluice.rollout.skew_dispatch import LongTailSplit


class SlotDispatch:
    """Longest-first turns for the proxy's requests (see the module docstring)."""

    def __init__(
        self,
        predictor: LengthPredictor,
        slots: int | None,
        states: Mapping[int, ReplicaState],
        router: AffinityRouter,
        paused: Callable[[], bool],
        long_tail: LongTailSplit | None = None,
    ) -> None:
        if slots is None or slots < 1:
            raise ValueError(f"longest-first dispatch needs slots >= 1 per replica, got {slots}")
        self.queue = LongestFirstQueue(predictor, self._lane if long_tail is not None else None)
        self.slots, self.long_tail = slots, long_tail
        self._states, self._router, self._paused = states, router, paused
        self._release_soon = False

    def predict(self, request: GenerationRequest) -> float:
        """The predicted response length of ``request`` (recorded for the long-tail threshold)."""
        if self.long_tail is not None:
            self.long_tail.record(request.prompt_ids)
        return self.queue.predict(request.prompt_ids, request.params.max_new_tokens)

    def observe(self, request: GenerationRequest, length: int) -> None:
        """A finished response's length: the predictor learns from it."""
        self.queue.observe(request.prompt_ids, length)

    async def turn(self, flight: Flight) -> ReplicaState | None:
        """Wait for a slot for ``flight`` (reserved on the replica it returns); ``None`` if the
        request was aborted meanwhile."""
        flight.waiting = self.queue.wait(flight.predicted or 0.0, flight)
        if not self._release_soon:  # next loop iteration: requests arriving together are ranked together
            self._release_soon = True
            asyncio.get_running_loop().call_soon(self.release)
        try:
            state: ReplicaState | None = await flight.waiting
        except asyncio.CancelledError:  # released, then cancelled before it could run
            self._unreserve(flight.waiting)
            raise
        if flight.user_aborted:  # aborted between its release and now
            self._unreserve(flight.waiting)
            return None
        return state

    def release(self) -> None:
        """Give the free slots to the longest waiting requests."""
        self._release_soon = False
        self.queue.release(self._take_slot)

    def fail(self, error: BaseException) -> None:
        """End every waiting request with ``error`` (no replica will ever take them)."""
        self.queue.fail(error)

    def stats(self) -> dict[str, float]:
        stats = {"lpt_waiting": float(len(self.queue)), "lpt_observed": float(self.queue.observed)}
        if self.long_tail is not None:
            stats["long_tail_replicas"] = float(len(self.long_tail.dedicated))
        return stats

    def _unreserve(self, turn: asyncio.Future[Any]) -> None:
        """Give back the slot a released request will not use."""
        if turn.done() and not turn.cancelled() and turn.result() is not None:
            turn.result().reserved -= 1
            self.release()

    def _lane(self, flight: Flight) -> bool:
        """Skewness-aware dispatch: whether ``flight`` belongs to the predicted long tail."""
        assert self.long_tail is not None
        flight.tail = self.long_tail.is_tail(flight.request.prompt_ids, self.queue.predictor)
        return flight.tail

    def _take_slot(self, flight: Flight) -> ReplicaState | None:
        """A replica with a free slot for ``flight`` (reserved), or ``None``; with skewness-aware
        dispatch, on its lane's side under that replica's cap."""
        if self._paused():
            return None
        split = self.long_tail
        free = []
        for replica_id in list(self._states) if split is None else split.pool(self._states, flight.tail):
            state = self._states[replica_id]
            cap = self.slots if split is None else split.cap(replica_id, self.slots)
            if state.accepting and len(state.flights) + state.reserved < cap:
                free.append(state)
        picked = self._router.pick(flight.request, free)
        if picked is not None:
            picked.reserved += 1
        return picked
