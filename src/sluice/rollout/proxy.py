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
from dataclasses import dataclass, field
from typing import Any

from sluice.api import Completion, GenerationRequest, LengthPredictor, Replica
from sluice.api.protocols import WeightUpdateMode
from sluice.rollout.lpt_queue import LongestFirstQueue
from sluice.rollout.replicas import as_replica, merge_engine_stats
from sluice.rollout.single_turn import sample_seed

logger = logging.getLogger(__name__)

_MODES = ("interrupt", "defer", "staggered")


@dataclass(eq=False)
class _ReplicaState:
    replica_id: int
    replica: Replica
    version: int
    accepting: bool = False
    outstanding: float = 0.0
    reserved: int = 0  # slots given to requests the longest-first queue released, not yet running
    flights: set[str] = field(default_factory=set)


@dataclass(eq=False)
class _Flight:
    request: GenerationRequest
    replica_id: int | None = None
    user_aborted: bool = False
    displaced: bool = False
    predicted: float | None = None  # response length, when a length predictor orders requests
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
    ) -> None:
        if stagger < 1:
            raise ValueError(f"stagger must be >= 1, got {stagger}")
        if length_predictor is not None and (slots is None or slots < 1):
            raise ValueError(f"longest-first dispatch needs slots >= 1 per replica, got {slots}")
        self.prompt_replication = prompt_replication
        self.stagger = stagger
        self.version = version
        """The newest version pushed to the replicas (each holds it once its update lands)."""
        self.poll_s = poll_s
        self._states: dict[int, _ReplicaState] = {}
        self._next_id = 0
        for engine in replicas:  # construction-time replicas hold ``version`` already
            self._new_state(as_replica(engine), version).accepting = True
        self._flights: dict[str, _Flight] = {}
        self._affinity: dict[str, tuple[int, int]] = {}  # key -> (replica id, requests in flight)
        self._weights: Mapping[str, Any] | None = None
        self._paused = False
        self._waiters: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._updating: asyncio.Task[None] | None = None
        self._counts: Counter[str] = Counter()
        self._lpt = LongestFirstQueue(length_predictor) if length_predictor is not None else None
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
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason = "abort"
        try:
            while not flight.user_aborted:
                state = await self._route(flight)
                if state is None:
                    break
                part = await self._run_on(state, flight, self._continuation(request, tokens))
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
        state.accepting = True
        self._counts["replicas_added"] += 1
        self._notify()
        return state.replica_id

    async def remove_replica(self, replica_id: int) -> int:
        """Stop routing to a replica, move its in-flight requests elsewhere (they continue from
        their partial responses once any replica accepts), forget it; returns how many moved."""
        state = self._states[replica_id]
        state.accepting = False
        moving = [self._flights[rid] for rid in state.flights]
        for flight in moving:
            flight.displaced = True
        await asyncio.gather(*(state.replica.abort(f.request.request_id) for f in moving))
        while state.flights:
            await self._wait_change()
        del self._states[replica_id]
        self._affinity = {k: v for k, v in self._affinity.items() if v[0] != replica_id}
        self._counts["replicas_removed"] += 1
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

    async def _staggered(self, waves: list[list[_ReplicaState]], weights: Mapping[str, Any], version: int) -> None:
        for wave in waves:
            for state in wave:
                state.accepting = False
            await asyncio.gather(*(s.replica.update_weights(weights, version, "defer") for s in wave))
            await self._wait_all(wave, version)
            for state in wave:
                state.accepting = state.replica_id in self._states
            self._notify()
        self._counts["staggered_updates"] += 1

    async def _wait_all(self, states: list[_ReplicaState], version: int) -> None:
        await asyncio.gather(*(self._wait_version(s, version) for s in states))

    async def _wait_version(self, state: _ReplicaState, version: int) -> None:
        while (await state.replica.stats())["version"] < version:
            await asyncio.sleep(self.poll_s)
        state.version = max(state.version, version)

    async def _route(self, flight: _Flight) -> _ReplicaState | None:
        """The replica for ``flight`` (waiting while paused or none accepts); ``None`` if it was
        aborted while it waited. Longest-first: waits for its turn in the queue instead."""
        if self._lpt is not None:
            flight.waiting = self._lpt.wait(flight.predicted or 0.0, flight)
            if not self._release_soon:  # next loop iteration: requests arriving together are ranked together
                self._release_soon = True
                asyncio.get_running_loop().call_soon(self._release)
            try:
                state: _ReplicaState | None = await flight.waiting
            except asyncio.CancelledError:  # released, then cancelled before it could run
                self._unreserve(flight.waiting)
                raise
            if flight.user_aborted:  # aborted between its release and now
                self._unreserve(flight.waiting)
                return None
            return state
        while not flight.user_aborted:
            state = None if self._paused else self._pick(flight.request)
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

    def _take_slot(self, flight: _Flight) -> _ReplicaState | None:
        """Longest-first: a replica with a free slot for ``flight`` (reserved), or ``None``."""
        if self._paused:
            return None
        free = [s for s in self._states.values() if s.accepting and len(s.flights) + s.reserved < self.slots]
        state = self._pick(flight.request, free)
        if state is not None:
            state.reserved += 1
        return state

    def _pick(self, request: GenerationRequest, candidates: list[_ReplicaState] | None = None) -> _ReplicaState | None:
        open_states = [s for s in self._states.values() if s.accepting] if candidates is None else candidates
        if not open_states:
            return None
        key = None if self.prompt_replication else request.affinity
        if key is not None and key in self._affinity:
            replica_id, count = self._affinity[key]
            state = self._states.get(replica_id)
            if state is not None and state in open_states:
                self._affinity[key] = (replica_id, count + 1)
                return state
        state = min(open_states, key=lambda s: (s.outstanding, s.replica_id))
        if key is not None:
            self._affinity[key] = (state.replica_id, 1)
        return state

    async def _run_on(self, state: _ReplicaState, flight: _Flight, request: GenerationRequest) -> Completion:
        budget = request.params.max_new_tokens
        rid, cost = request.request_id, len(request.prompt_ids) + min(flight.predicted or budget, budget)
        if self._lpt is not None:
            state.reserved -= 1
        state.outstanding += cost
        state.flights.add(rid)
        flight.replica_id = state.replica_id
        self._counts["routed"] += 1
        try:
            return await state.replica.generate(request)
        finally:
            state.outstanding -= cost
            state.flights.discard(rid)
            flight.replica_id = None
            self._release_affinity(request.affinity, state.replica_id)
            self._notify()

    def _release_affinity(self, key: str | None, replica_id: int) -> None:
        entry = self._affinity.get(key) if key is not None else None
        if entry is not None and entry[0] == replica_id:
            if entry[1] <= 1:
                del self._affinity[key]  # type: ignore[arg-type]
            else:
                self._affinity[key] = (replica_id, entry[1] - 1)  # type: ignore[index]

    @staticmethod
    def _continuation(request: GenerationRequest, tokens: list[int]) -> GenerationRequest:
        """The rest of ``request`` after ``tokens``: prompt + tokens so far, the remaining length,
        and a fresh sampling stream (the new replica's counter starts at 0)."""
        if not tokens:
            return request
        params = request.params
        rest = type(params)(
            params.max_new_tokens - len(tokens), params.temperature, params.top_p, params.stop_token_ids
        )
        return GenerationRequest(
            request.request_id,
            request.prompt_ids + tuple(tokens),
            rest,
            seed=sample_seed(request.seed, len(tokens), 1),
            affinity=request.affinity,
        )

    def _new_state(self, replica: Replica, version: int) -> _ReplicaState:
        state = _ReplicaState(self._next_id, replica, version)
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
