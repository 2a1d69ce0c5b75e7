"""``LLMProxy``: one ``InferenceEngine`` front for many replicas (ROLL Flash's LLMProxy).

Each verb in detail: docs/rollout.md ("LLMProxy").

- **Routing**: each request goes to the accepting replica with the fewest outstanding tokens;
  requests sharing an ``affinity`` (one prompt's samples) stick to one replica unless prompts
  are replicated (ROLL Flash §5.1.2).
- **Longest predicted first** (optional, StreamRL): with a ``LengthPredictor``, a free replica
  slot goes to the waiting request with the longest predicted response (``LongestFirstQueue``);
  a ``LongTailSplit`` may dedicate replicas to the predicted long tail.
- **Requests**: ``generate`` / ``abort`` as for one engine; ``pause`` holds new requests at the
  proxy and pauses the replicas; ``resume`` releases both.
- **Replicas at run time**: ``add_replica`` loads the newest weights before routing to one;
  ``remove_replica`` and a replica that died (``ReplicaLost``) move its requests elsewhere,
  continuing from their partial responses (counted); a ``replace`` factory brings in a new one.
  ``busy_s`` is the generation time a rebalancer weighs (``controller/rebalancing.py``).
- **Weight updates**: ``interrupt`` and ``defer`` go to every replica at once; ``staggered``
  updates ``stagger`` replicas at a time, routing around them while they drain and swap.

It does not decide what to generate or when weights change (the rollout worker and the
controller do), and it never looks inside an engine beyond the ``Replica`` verbs.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any

from sluice.api import Completion, GenerationRequest, LengthPredictor, Replica, ReplicaLost
from sluice.api.protocols import WeightUpdateMode
from sluice.rollout.replicas import as_replica, merge_engine_stats
from sluice.rollout.routing import AffinityRouter, Flight, ReplicaState, continuation
from sluice.rollout.skew_dispatch import LongTailSplit
from sluice.rollout.slot_dispatch import SlotDispatch

logger = logging.getLogger(__name__)

_MODES = ("interrupt", "defer", "staggered")
_NONE_LEFT = "every engine replica died and none replaces them"


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
        replace: Callable[[], Awaitable[Any]] | None = None,
        replacements: int = 3,
    ) -> None:
        if stagger < 1:
            raise ValueError(f"stagger must be >= 1, got {stagger}")
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
        self._flights: dict[str, Flight] = {}
        self._router = AffinityRouter(prompt_replication)
        self._weights: Mapping[str, Any] | None = None
        self._paused = False
        self._waiters: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._updating: asyncio.Task[None] | None = None
        self._counts: Counter[str] = Counter()
        if long_tail is not None:
            if self._states and long_tail.replicas >= len(self._states):
                raise ValueError(  # fleet.long_tail_replicas >= resources.rollout.replicas
                    f"{long_tail.replicas} long-tail replicas leave none of {len(self._states)} for the rest"
                )
            for replica_id in self._states:
                long_tail.join(replica_id)
        self._dispatch = (
            None
            if length_predictor is None
            else SlotDispatch(length_predictor, slots, self._states, self._router, lambda: self._paused, long_tail)
        )
        self._long_tail = long_tail
        self.slots = slots or 0
        self._replace, self._replacements, self._replacing = replace, replacements, 0
        self._turn_s: deque[float] = deque(maxlen=1024)  # wall time of the latest requests
        self._busy_s = 0.0  # replica-seconds with a request running, of finished busy spells

    @property
    def replica_ids(self) -> list[int]:
        return list(self._states)

    @property
    def replicas(self) -> list[Replica]:
        """The replicas routed to now (a lost one is gone from this list)."""
        return [state.replica for state in self._states.values()]

    async def generate(self, request: GenerationRequest) -> Completion:
        """Route ``request``, and continue it elsewhere if its replica is removed mid-way."""
        rid = request.request_id
        if rid in self._flights:
            raise ValueError(f"request {rid!r} is already in flight")
        flight = self._flights[rid] = Flight(request)
        started = time.perf_counter()
        if self._dispatch is not None:
            flight.predicted = self._dispatch.predict(request)
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
            self._turn_s.append(time.perf_counter() - started)
        if self._dispatch is not None and reason != "abort":
            self._dispatch.observe(request, len(tokens))
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
            state = self._states[flight.replica_id]
            self._spawn(self._guard(state, state.replica.abort(request_id)))
        self._notify()

    def pause(self) -> None:
        """Hold new requests here and pause every replica (running requests stay where they are)."""
        self._paused = True
        for state in self._states.values():
            self._spawn(self._guard(state, state.replica.pause()))

    def resume(self) -> None:
        self._paused = False
        for state in self._states.values():
            self._spawn(self._guard(state, state.replica.resume()))
        self._notify()

    def update_weights(self, weights: Mapping[str, Any], version: int, mode: WeightUpdateMode = "interrupt") -> None:
        """``InferenceEngine``'s verb: start ``sync_weights`` on the running event loop."""
        self._spawn(self.sync_weights(weights, version, mode))

    def stats(self) -> dict[str, float]:
        """Proxy counters; ``version`` is the oldest version a replica holds, ``pending_version``
        the one being rolled out (-1: none); ``request_s_median``: the median wall time of the
        latest 1024 requests (one generation turn each)."""
        held = min((s.version for s in self._states.values()), default=self.version)
        return {
            **(self._dispatch.stats() if self._dispatch is not None else {}),
            "replicas": float(len(self._states)),
            "accepting": float(sum(s.accepting for s in self._states.values())),
            "in_flight": float(len(self._flights)),
            "request_s_median": statistics.median(self._turn_s) if self._turn_s else 0.0,
            "busy_s": self.busy_s(),
            **{name: float(value) for name, value in self._counts.items()},
            "version": float(held),
            "pending_version": float(self.version if held < self.version else -1),
        }

    def busy_s(self, now: float | None = None) -> float:
        """Replica-seconds so far during which a replica had at least one request running."""
        now = time.perf_counter() if now is None else now
        running = sum(now - s.busy_since for s in self._states.values() if s.busy_since is not None)
        return self._busy_s + running

    async def engine_stats(self) -> dict[str, float]:
        """Every replica's ``stats()`` merged (``merge_engine_stats``)."""
        every = await asyncio.gather(*(self._guard(s, s.replica.stats()) for s in list(self._states.values())))
        return merge_engine_stats(stats for stats in every if stats is not None)

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
        await asyncio.gather(*(self._guard(s, s.replica.update_weights(weights, version, engine_mode)) for s in states))
        self._updating = self._spawn(self._wait_all(states, version))

    async def settled(self) -> float:
        """The version every replica holds, once the latest ``sync_weights`` reached them all."""
        if self._updating is not None and not self._updating.done():
            await asyncio.shield(self._updating)  # a cancelled waiter leaves the rollout running
        return self.stats()["version"]

    async def _staggered(self, waves: list[list[ReplicaState]], weights: Mapping[str, Any], version: int) -> None:
        for wave in waves:
            for state in wave:
                state.accepting = False
            await asyncio.gather(*(self._guard(s, s.replica.update_weights(weights, version, "defer")) for s in wave))
            await self._wait_all(wave, version)
            for state in wave:
                state.accepting = state.replica_id in self._states
            self._notify()
        self._counts["staggered_updates"] += 1

    async def _wait_all(self, states: list[ReplicaState], version: int) -> None:
        await asyncio.gather(*(self._wait_version(s, version) for s in states))

    async def _wait_version(self, state: ReplicaState, version: int) -> None:
        while (stats := await self._guard(state, state.replica.stats())) is not None and stats["version"] < version:
            await asyncio.sleep(self.poll_s)
        state.version = max(state.version, version)

    async def _route(self, flight: Flight) -> ReplicaState | None:
        """The replica for ``flight`` (waiting while paused or none accepts); ``None`` if it was
        aborted while it waited. Longest-first: waits for its turn in the queue instead."""
        if self._fleet_dead():
            raise ReplicaLost(_NONE_LEFT)
        if self._dispatch is not None:
            return await self._dispatch.turn(flight)
        while not flight.user_aborted:
            state = None if self._paused else self._router.pick(flight.request, self._accepting())
            if state is not None:
                return state
            if self._fleet_dead():
                raise ReplicaLost(_NONE_LEFT)
            await self._wait_change()
        return None

    async def _run_on(self, state: ReplicaState, flight: Flight, request: GenerationRequest) -> Completion:
        budget = request.params.max_new_tokens
        rid, cost = request.request_id, len(request.prompt_ids) + min(flight.predicted or budget, budget)
        if self._dispatch is not None:
            state.reserved -= 1
        state.outstanding += cost
        if not state.flights:
            state.busy_since = time.perf_counter()
        state.flights.add(rid)
        flight.replica_id = state.replica_id
        self._counts["routed"] += 1
        if flight.tail:
            self._counts["long_tail_routed"] += 1
        try:
            return await state.replica.generate(request)
        except ReplicaLost:  # continue elsewhere from the tokens before this replica
            self._lose(state)
            return Completion(rid, request.prompt_ids, (), (), (), "abort")
        finally:
            state.outstanding -= cost
            state.flights.discard(rid)
            if not state.flights and state.busy_since is not None:
                self._busy_s += time.perf_counter() - state.busy_since
                state.busy_since = None
            flight.replica_id = None
            self._router.release(request.affinity, state.replica_id)
            self._notify()

    async def _guard(self, state: ReplicaState, call: Awaitable[Any]) -> Any:
        """``call`` on ``state``'s replica; ``None`` (and the replica dropped) if its process died."""
        try:
            return await call
        except ReplicaLost:
            self._lose(state)
            return None

    def _lose(self, state: ReplicaState) -> None:
        """A replica's process died: forget it, displace its requests (each continues elsewhere),
        start a replacement while allowed; with none left and none coming, fail the waiting."""
        if self._states.get(state.replica_id) is not state:
            return  # already lost
        del self._states[state.replica_id]
        state.accepting = False
        self._router.forget(state.replica_id)
        if self._long_tail is not None:
            self._long_tail.leave(state.replica_id)
        for rid in state.flights:
            self._flights[rid].displaced = True
        self._counts["replicas_lost"] += 1
        replace = self._replace is not None and self._counts["replicas_lost"] <= self._replacements
        logger.warning("engine replica %d died; %s", state.replica_id, "replacing it" if replace else "not replaced")
        if replace:
            self._replacing += 1
            self._spawn(self._replace_lost())
        self._notify()

    async def _replace_lost(self) -> None:
        assert self._replace is not None
        try:
            await self.add_replica(await self._replace())
        finally:
            self._replacing -= 1
            self._notify()

    def _fleet_dead(self) -> bool:
        """Replicas died, none is left and none is coming."""
        return not self._states and not self._replacing and self._counts["replicas_lost"] > 0

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
        if self._dispatch is not None:
            if self._fleet_dead():
                self._dispatch.fail(ReplicaLost(_NONE_LEFT))
            self._dispatch.release()
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
