"""Adapters that make inference engines ``Replica`` s for ``LLMProxy``: an in-process engine, or a
Ray actor whose class implements ``InferenceEngine`` (``ray.remote(HFInferenceEngine)``,
``ray.remote(SimEngine)``, ``EngineHost``, ...). They translate calls only; routing and bookkeeping
are the proxy's. ``EngineHost`` builds any ``rollout.engine`` inside its own actor process
(``start_engine_actors``), so replicas decode in parallel processes; ``watch_replicas`` kills one
that stops answering its heartbeat (the proxy then replaces it as a dead one).
``merge_engine_stats`` folds many engines' ``stats()`` into one.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

from sluice.api import Completion, GenerationRequest, Replica, ReplicaLost, VersionedEngine
from sluice.api.health import HEALTH
from sluice.api.protocols import WeightUpdateMode

logger = logging.getLogger(__name__)


class LocalReplica:
    """A ``VersionedEngine`` in this process (its generate runs on this event loop)."""

    def __init__(self, engine: VersionedEngine) -> None:
        self.engine = engine

    async def generate(self, request: GenerationRequest) -> Completion:
        return await self.engine.generate(request)  # cancelling it aborts the request

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def pause(self) -> None:
        self.engine.pause()

    async def resume(self) -> None:
        self.engine.resume()

    async def update_weights(self, weights: Mapping[str, Any], version: int, mode: WeightUpdateMode) -> None:
        self.engine.update_weights(weights, version, mode)

    async def stats(self) -> dict[str, float]:
        return self.engine.stats()


class RayReplica:
    """A Ray actor handle of an ``InferenceEngine`` class; weights travel through the object store.
    A call on an actor whose process died raises ``ReplicaLost`` (Ray's ``RayActorError``: the
    actor is not restarted, its engine state is gone)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def generate(self, request: GenerationRequest) -> Completion:
        ref = self.handle.generate.remote(request)
        try:
            result: Completion = await _answer(ref)
            return result
        except asyncio.CancelledError:  # awaiting a ref does not stop the remote call
            self.handle.abort.remote(request.request_id)
            raise

    async def abort(self, request_id: str) -> None:
        await _answer(self.handle.abort.remote(request_id))

    async def pause(self) -> None:
        await _answer(self.handle.pause.remote())

    async def resume(self) -> None:
        await _answer(self.handle.resume.remote())

    async def update_weights(self, weights: Mapping[str, Any], version: int, mode: WeightUpdateMode) -> None:
        await _answer(self.handle.update_weights.remote(dict(weights), version, mode))

    async def stats(self) -> dict[str, float]:
        result: dict[str, float] = await _answer(self.handle.stats.remote())
        return result


async def _answer(ref: Any) -> Any:
    """The result of a Ray actor call; ``ReplicaLost`` when the actor's process died."""
    from ray.exceptions import RayActorError

    try:
        return await ref
    except RayActorError as err:
        raise ReplicaLost(f"engine replica actor died: {type(err).__name__}") from err


class EngineHost:
    """A Ray actor body: one inference engine (``engines.build_inference_engine``) in this process,
    serving ``InferenceEngine``'s verbs (``generate`` is a coroutine on the actor's event loop, so
    one actor decodes many requests at once) plus ``weights_checksum`` for fingerprints."""

    def __init__(self, kind: str, model_dir: str, max_batch: int, options: Mapping[str, Any], threads: int) -> None:
        import torch

        from sluice.engines import build_inference_engine

        torch.set_num_threads(threads)
        self.engine: Any = build_inference_engine(kind, model_dir, max_batch=max_batch, options=options)

    async def generate(self, request: GenerationRequest) -> Completion:
        result: Completion = await self.engine.generate(request)
        return result

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def update_weights(self, weights: Mapping[str, Any], version: int, mode: WeightUpdateMode) -> None:
        self.engine.update_weights(weights, version, mode)

    def stats(self) -> dict[str, float]:
        result: dict[str, float] = self.engine.stats()
        return result

    def weights_checksum(self) -> float:
        return float(self.engine.weights_checksum())

    def heartbeat(self) -> float:
        return time.process_time()  # in the HEALTH group: answered while the engine decodes


def start_engine_actors(
    count: int,
    kind: str,
    model_dir: str,
    *,
    max_batch: int,
    options: Mapping[str, Any],
    threads: int,
    placement: Mapping[str, Any] | None = None,
) -> list[Any]:
    """``count`` ``EngineHost`` actors (Ray must be initialised: the caller is a Ray actor or
    driver). They reserve no Ray CPU, like the reference worker: on a small machine they must be
    placed beside the rollout worker that owns them; ``threads`` torch threads each. No runtime
    environment of their own, so Ray can start them in its already running idle workers.
    ``placement``: their Ray options from the pipeline's placement (GPUs each, the rollout
    worker's placement-group bundle)."""
    import ray

    host: Any = ray.remote(num_cpus=0, concurrency_groups={HEALTH: 1})(EngineHost).options(**(placement or {}))
    return [host.remote(kind, model_dir, max_batch, dict(options), threads) for _ in range(count)]


async def engine_fingerprint(replica: Replica) -> tuple[int, float]:
    """(version, weights checksum) of a replica over an in-process engine or an ``EngineHost``."""
    if isinstance(replica, RayReplica):
        stats, checksum = await replica.stats(), await _answer(replica.handle.weights_checksum.remote())
        return int(stats["version"]), float(checksum)
    engine = replica.engine if isinstance(replica, LocalReplica) else cast(VersionedEngine, replica)
    return engine.version, engine.weights_checksum()


async def watch_replicas(replicas: Callable[[], list[Replica]], timeout_s: float, counts: dict[str, float]) -> None:
    """Forever: ping every Ray actor replica's heartbeat; kill one silent for ``timeout_s`` (stopped
    or hung: its calls then fail and the proxy replaces it), counting ``replicas_silent``."""
    import ray

    interval = min(5.0, timeout_s / 4)
    heard: dict[int, float] = {}
    while True:
        handles = {id(r): r.handle for r in replicas() if isinstance(r, RayReplica)}
        pings = {key: asyncio.ensure_future(_ping(handle)) for key, handle in handles.items()}
        await asyncio.sleep(interval)
        now = time.monotonic()
        for key, ping in pings.items():
            if ping.done():
                heard[key] = now
            else:
                ping.cancel()
            if now - heard.setdefault(key, now) > timeout_s:
                logger.warning("an engine replica sent no heartbeat for %.0f s: killed, to be replaced", timeout_s)
                ray.kill(handles[key])
                counts["replicas_silent"] = counts.get("replicas_silent", 0.0) + 1
                del heard[key]


async def _ping(handle: Any) -> None:
    from ray.exceptions import RayActorError

    with contextlib.suppress(RayActorError):  # a dead replica is the proxy's to find, not a silent one
        await handle.heartbeat.options(concurrency_group=HEALTH).remote()


def as_replica(engine: Any) -> Replica:
    """``engine`` as a ``Replica``: adapters and other replicas (whose verbs are coroutines) pass
    through, Ray actor handles become ``RayReplica``, anything else is taken for an in-process
    ``InferenceEngine``."""
    if isinstance(engine, LocalReplica | RayReplica) or inspect.iscoroutinefunction(
        getattr(engine, "update_weights", None)
    ):
        return engine
    if "ray" in sys.modules:  # only a program that imported Ray can hold an actor handle
        from ray.actor import ActorHandle

        if isinstance(engine, ActorHandle):
            return RayReplica(engine)
    return LocalReplica(engine)


_OLDEST = ("version",)
_NEWEST = ("pending_version", "version_activated_at")


def merge_engine_stats(per_engine: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """One ``stats()`` for many engines: counters add up; ``version`` is the oldest any engine
    holds (every engine holds at least it), ``pending_version`` / ``version_activated_at`` the
    newest."""
    merged: dict[str, float] = {}
    for stats in per_engine:
        for name, value in stats.items():
            if name not in merged:
                merged[name] = value
            elif name in _OLDEST:
                merged[name] = min(merged[name], value)
            elif name in _NEWEST:
                merged[name] = max(merged[name], value)
            else:
                merged[name] += value
    return merged
