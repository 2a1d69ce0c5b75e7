"""``LLMProxy``: one ``InferenceEngine`` front for many replicas (ROLL Flash's LLMProxy).

- **Routing**: each request goes to the accepting replica with the fewest outstanding tokens
  (prompt + ``max_new_tokens`` of requests routed there and not finished). Without prompt
  replication, requests sharing an ``affinity`` (the samples of one prompt) stick to the replica
  the first of them went to (prefix sharing); with it, every sample is routed on its own, so a
  hard prompt's n long samples spread over the replicas (ROLL Flash §5.1.2).
- **Longest predicted first** (optional, StreamRL): with a ``LengthPredictor`` the proxy holds
  requests in a ``LongestFirstQueue`` and gives each free replica slot (``slots`` running
  requests per replica) to the waiting request with the longest predicted response; routing
  then weighs requests by predicted rather than maximum length, and the predictor learns from
  every finished response.
- **Skewness-aware dispatch** (optional, StreamRL, on top of longest-first): a ``LongTailSplit``
  dedicates some replicas to the requests predicted to be in the long tail, at a smaller cap on
  running requests (fast per token), and keeps the rest on the other replicas; one longest-first
  lane per side.
- **Requests**: ``generate`` / ``abort`` as for one engine; ``pause`` holds new requests at the
  proxy and pauses the replicas; ``resume`` releases both.
- **Replicas at run time**: ``add_replica`` loads the newest weights into a newcomer before
  routing to it; ``remove_replica`` stops routing to one, aborts its in-flight requests and
  continues each elsewhere from its partial response (prompt + tokens so far, tokens keep their
  versions): nothing is lost, every move is counted (``rerouted``, ``rerouted_tokens``).
- **Weight updates** (DESIGN.md): ``interrupt`` and ``defer`` go to every replica at once;
  ``staggered`` updates ``stagger`` replicas at a time, routing around them while they drain
  and swap, so generation never stops everywhere.

It does not decide what to generate or when weights change (the rollout worker and the
controller do), and it never looks inside an engine beyond the ``Replica`` verbs.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sluice.api import Completion, GenerationRequest, LengthPredictor, Replica
from sluice.api.protocols import WeightUpdateMode
from sluice.rollout.lpt_queue import LongestFirstQueue
from sluice.rollout.replicas import as_replica, merge_engine_stats
from sluice.rollout.routing import AffinityRouter, ReplicaState, continuation
from sluice.rollout.skew_dispatch import LongTailSplit

logger = logging.getLogger(__name__)

_MODES = ("interrupt", "defer", "staggered")


@dataclass(eq=False)
class _Flight:
    request: GenerationRequest
    replica_id: int | None = None
    user_aborted: bool = False
    displaced: bool = False
    predicted: float | None = None  # response length, when a length predictor orders requests
    tail: bool = False  # predicted to be in the long tail (skewness-aware dispatch)
    waiting: asyncio.Future[Any] | None = None  # its turn in the longest-first queue


class LLMProxy:
    """Routes requests over replicas and updates their weights (see the module docstring)."""

    def __init__(
        self,
        replicas: Iterable[Any] = (),
        *,
        prompt_replication: bool = True,
        stagger: int = 1,
        version: int = 0,
        poll_s: float = 0.005,
        length_predictor: LengthPredictor | None = None,
        slots: int | None = None,
        long_tail: LongTailSplit | None = None,
    ) -> None:
        if stagger < 1:
            raise ValueError(f"stagger must be >= 1, got {stagger}")
        if length_predictor is not None and (slots is None or slots < 1):
            raise ValueError(f"longest-first dispatch needs slots >= 1 per replica, got {slots}")
        if long_tail is not None and length_predictor is None:
            raise ValueError("skewness-aware dispatch needs a length predictor (the long tail is predicted)")
        self.stagger = stagger
        self.version = version
        """The newest version pushed to the replicas (each holds it once its update lands)."""
        self.poll_s = poll_s
        self._states: dict[int, ReplicaState] = {}
        self._next_id = 0
        for engine in replicas:  # construction-time replicas hold ``version`` already
            self._new_state(as_replica(engine), version).accepting = True
        self._flights: dict[str, _Flight] = {}
        self._router = AffinityRouter(prompt_replication)
        self._weights: Mapping[str, Any] | None = None
        self._paused = False
        self._waiters: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._updating: asyncio.Task[None] | None = None
        self._counts: Counter[str] = Counter()
        self._long_tail = long_tail
        if long_tail is not None:
            if self._states and long_tail.replicas >= len(self._states):
                raise ValueError(  # fleet.long_tail_replicas >= rollout.replicas
                    f"{long_tail.replicas} long-tail replicas leave none of {len(self._states)} for the rest"
                )
            for replica_id in self._states:
                long_tail.join(replica_id)
        lane = self._lane if long_tail is not None else None
        self._lpt = LongestFirstQueue(length_predictor, lane) if length_predictor is not None else None
        self.slots = slots or 0
        self._release_soon = False

    @property
    def replica_ids(self) -> list[int]:
        return list(self._states)

    async def generate(self, request: GenerationRequest) -> Completion:
        """Route ``request``, and continue it elsewhere if its replica is removed mid-way."""
        rid = request.request_id
        if rid in self._flights:
            raise ValueError(f"request {rid!r} is already in flight")
        flight = self._flights[rid] = _Flight(request)
        if self._lpt is not None:
            flight.predicted = self._lpt.predict(request.prompt_ids, request.params.max_new_tokens)
            if self._long_tail is not None:
                self._long_tail.record(request.prompt_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason = "abort"
        try:
            while not flight.user_aborted:
                state = await self._route(flight)
                if state is None:
                    break
                part = await self._run_on(state, flight, continuation(request, tokens))
                tokens += part.token_ids
                logprobs += part.logprobs
                versions += part.versions
                reason = part.finish_reason
                if reason != "abort" or not flight.displaced or flight.user_aborted:
                    break
                flight.displaced = False
                self._counts["rerouted"] += 1
                self._counts["rerouted_tokens"] += len(tokens)
                if len(tokens) >= request.params.max_new_tokens:
                    reason = "length"
                    break
        finally:
            del self._flights[rid]
        if self._lpt is not None and reason != "abort":
            self._lpt.observe(request.prompt_ids, len(tokens))
        args = (tuple(tokens), tuple(logprobs), tuple(versions), reason)
        return Completion(rid, request.prompt_ids, *args)  # type: ignore[arg-type]

    def abort(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is None:
            return
        flight.user_aborted = True
        if flight.waiting is not None and not flight.waiting.done():
            flight.waiting.set_result(None)
        if flight.replica_id is not None:
            self._spawn(self._states[flight.replica_id].replica.abort(request_id))
        self._notify()

    def pause(self) -> None:
        """Hold new requests here and pause every replica (running requests stay where they are)."""
        self._paused = True
        for state in self._states.values():
            self._spawn(state.replica.pause())

    def resume(self) -> None:
        self._paused = False
        for state in self._states.values():
            self._spawn(state.replica.resume())
        self._notify()

    def update_weights(self, weights: Mapping[str, Any], version: int, mode: WeightUpdateMode = "interrupt") -> None:
        """``InferenceEngine``'s verb: start ``sync_weights`` on the running event loop."""
        self._spawn(self.sync_weights(weights, version, mode))

    def stats(self) -> dict[str, float]:
        """Proxy counters; ``version`` is the oldest version a replica holds, ``pending_version``
        the one being rolled out (-1: none)."""
        held = min((s.version for s in self._states.values()), default=self.version)
        lpt = (
            {}
            if self._lpt is None
            else {"lpt_waiting": float(len(self._lpt)), "lpt_observed": float(self._lpt.observed)}
        )
        if self._long_tail is not None:
            lpt["long_tail_replicas"] = float(len(self._long_tail.dedicated))
        return {
            **lpt,
            "replicas": float(len(self._states)),
            "accepting": float(sum(s.accepting for s in self._states.values())),
            "in_flight": float(len(self._flights)),
            **{name: float(value) for name, value in self._counts.items()},
            "version": float(held),
            "pending_version": float(self.version if held < self.version else -1),
        }

    async def engine_stats(self) -> dict[str, float]:
        """Every replica's ``stats()`` merged (``merge_engine_stats``)."""
        return merge_engine_stats(await asyncio.gather(*(s.replica.stats() for s in self._states.values())))

    async def add_replica(self, engine: Any) -> int:
        """Start routing to ``engine`` (an engine, actor handle or ``Replica``) once it holds the
        newest weights; returns its id."""
        replica = as_replica(engine)
        state = self._new_state(replica, int((await replica.stats())["version"]))
        if self._weights is not None and state.version < self.version:
            await replica.update_weights(self._weights, self.version, "interrupt")
            await self._wait_version(state, self.version)
        if self._paused:
            await replica.pause()
        if self._long_tail is not None:
            self._long_tail.join(state.replica_id)
        state.accepting = True
        self._counts["replicas_added"] += 1
        self._notify()
        return state.replica_id

    async def remove_replica(self, replica_id: int) -> int:
        """Stop routing to a replica, move its in-flight requests elsewhere (they continue from
        their partial responses once any replica accepts), forget it; returns how many moved."""
        state = self._states[replica_id]
        state.accepting = False
        if self._long_tail is not None:  # its side's waiting requests may now go to the other side
            self._long_tail.leave(replica_id)
        moving = [self._flights[rid] for rid in state.flights]
        for flight in moving:
            flight.displaced = True
        await asyncio.gather(*(state.replica.abort(f.request.request_id) for f in moving))
        while state.flights:
            await self._wait_change()
        del self._states[replica_id]
        self._router.forget(replica_id)
        self._counts["replicas_removed"] += 1
        self._notify()
        return len(moving)

    async def sync_weights(self, weights: Mapping[str, Any], version: int, mode: WeightUpdateMode) -> None:
        """Push ``version`` to every replica. Returns once ``interrupt`` replicas loaded it and
        ``defer`` replicas staged it (each swaps when drained); ``staggered`` returns at once and
        updates ``stagger`` replicas at a time in the background. ``stats()['version']`` says
        when all hold it. An update still rolling out finishes first."""
        if mode not in _MODES:
            raise ValueError(f"unknown weight update mode {mode!r}; expected one of {_MODES}")
        if self._updating is not None and not self._updating.done():
            await self._updating
        self._weights, self.version = weights, version
        states = list(self._states.values())
        if mode == "staggered" and len(states) > 1:
            waves = [states[i : i + self.stagger] for i in range(0, len(states), self.stagger)]
            self._updating = self._spawn(self._staggered(waves, weights, version))
            return
        engine_mode: WeightUpdateMode = "defer" if mode == "staggered" else mode
        await asyncio.gather(*(s.replica.update_weights(weights, version, engine_mode) for s in states))
        self._updating = self._spawn(self._wait_all(states, version))

    async def _staggered(self, waves: list[list[ReplicaState]], weights: Mapping[str, Any], version: int) -> None:
        for wave in waves:
            for state in wave:
                state.accepting = False
            await asyncio.gather(*(s.replica.update_weights(weights, version, "defer") for s in wave))
            await self._wait_all(wave, version)
            for state in wave:
                state.accepting = state.replica_id in self._states
            self._notify()
        self._counts["staggered_updates"] += 1

    async def _wait_all(self, states: list[ReplicaState], version: int) -> None:
        await asyncio.gather(*(self._wait_version(s, version) for s in states))

    async def _wait_version(self, state: ReplicaState, version: int) -> None:
        while (await state.replica.stats())["version"] < version:
            await asyncio.sleep(self.poll_s)
        state.version = max(state.version, version)

    async def _route(self, flight: _Flight) -> ReplicaState | None:
        """The replica for ``flight`` (waiting while paused or none accepts); ``None`` if it was
        aborted while it waited. Longest-first: waits for its turn in the queue instead."""
        if self._lpt is not None:
            flight.waiting = self._lpt.wait(flight.predicted or 0.0, flight)
            if not self._release_soon:  # next loop iteration: requests arriving together are ranked together
                self._release_soon = True
                asyncio.get_running_loop().call_soon(self._release)
            try:
                state: ReplicaState | None = await flight.waiting
            except asyncio.CancelledError:  # released, then cancelled before it could run
                self._unreserve(flight.waiting)
                raise
            if flight.user_aborted:  # aborted between its release and now
                self._unreserve(flight.waiting)
                return None
            return state
        while not flight.user_aborted:
            state = None if self._paused else self._router.pick(flight.request, self._accepting())
            if state is not None:
                return state
            await self._wait_change()
        return None

    def _release(self) -> None:
        self._release_soon = False
        if self._lpt is not None:
            self._lpt.release(self._take_slot)

    def _unreserve(self, turn: asyncio.Future[Any]) -> None:
        """Give back the slot a released request will not use."""
        if turn.done() and not turn.cancelled() and turn.result() is not None:
            turn.result().reserved -= 1
            self._notify()

    def _lane(self, flight: _Flight) -> bool:
        """Skewness-aware dispatch: whether ``flight`` belongs to the predicted long tail."""
        assert self._long_tail is not None and self._lpt is not None
        flight.tail = self._long_tail.is_tail(flight.request.prompt_ids, self._lpt.predictor)
        return flight.tail

    def _take_slot(self, flight: _Flight) -> ReplicaState | None:
        """Longest-first: a replica with a free slot for ``flight`` (reserved), or ``None``; with
        skewness-aware dispatch, on its lane's side under that replica's cap."""
        if self._paused:
            return None
        split = self._long_tail
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

    async def _run_on(self, state: ReplicaState, flight: _Flight, request: GenerationRequest) -> Completion:
        budget = request.params.max_new_tokens
        rid, cost = request.request_id, len(request.prompt_ids) + min(flight.predicted or budget, budget)
        if self._lpt is not None:
            state.reserved -= 1
        state.outstanding += cost
        state.flights.add(rid)
        flight.replica_id = state.replica_id
        self._counts["routed"] += 1
        if flight.tail:
            self._counts["long_tail_routed"] += 1
        try:
            return await state.replica.generate(request)
        finally:
            state.outstanding -= cost
            state.flights.discard(rid)
            flight.replica_id = None
            self._router.release(request.affinity, state.replica_id)
            self._notify()

    def _accepting(self) -> list[ReplicaState]:
        return [s for s in self._states.values() if s.accepting]

    def _new_state(self, replica: Replica, version: int) -> ReplicaState:
        state = ReplicaState(self._next_id, replica, version)
        self._states[state.replica_id] = state
        self._next_id += 1
        return state

    async def _wait_change(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        await future

    def _notify(self) -> None:
        self._release()
        waiters, self._waiters = self._waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # an update's error also
            self._counts["background_errors"] += 1  # re-raises from the next sync_weights
            logger.error("proxy background call failed", exc_info=task.exception())
