"""``SegmentedEngine``: the ``InferenceEngine`` Protocol over an engine that runs in another process.

vLLM and SGLang schedule their own batches; what sluice adds on top is versioning and the weight
update modes. A request runs as one or more **segments**, each one call to the backend under
one weight version: weights only change while no segment runs, so every token carries the
version its segment started under, exactly.

- ``interrupt`` (AReaL): abort the running segments, load, and resubmit each unfinished request
  as prompt + tokens so far for its remaining budget (the backend re-prefills it);
- ``defer`` / ``staggered``: let the running segments finish on the old weights, then load.
  A newer update replaces a staged one (counted). docs/engines.md, "Weight updates".

An update is staged at once by the engine's ``WeightStager``: written to a versioned tmpfs
folder and loaded by path (``weight_folder.py``: SGLang, vLLM with ``weight_transfer: folder``),
or kept as tensors in memory and loaded from them (``weight_tensors.py``: vLLM by default).
``update_weights``, ``abort``, ``pause`` and ``resume`` are synchronous (the Protocol) and
schedule their backend calls on the running event loop: call them from the loop that awaits
``generate``; ``stats()["version"]`` says when a new version is active. The backend does the
talking (``SegmentBackend``); this module holds no engine library.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from sluice.api.protocols import WeightUpdateMode
from sluice.api.types import Completion, FinishReason, GenerationRequest
from sluice.engines.sampling import seed_key
from sluice.engines.weight_folder import folder_weights

logger = logging.getLogger(__name__)

_MODES = ("interrupt", "defer", "staggered")


@dataclass(frozen=True)
class Segment:
    """One backend call: generate up to ``max_tokens`` after ``prompt_ids`` with ``request``'s
    temperature, top-p and stop tokens, seeded with ``seed``."""

    segment_id: str
    prompt_ids: tuple[int, ...]
    request: GenerationRequest
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class Delta:
    """New tokens of a running segment with their log-probs; ``finish_reason`` on the last one
    (``stop``, ``length`` or ``abort``)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None = None


class SegmentBackend(Protocol):
    """What an out-of-process engine must offer ``SegmentedEngine``."""

    def stream(self, segment: Segment) -> AsyncGenerator[Delta, None]:
        """Run ``segment``; closing the iterator early must stop it in the engine."""
        ...

    async def abort(self, segment_id: str) -> None: ...

    async def load(self, staged: Any, version: int) -> None:
        """Load what the engine's ``WeightStager.write`` returned for ``version`` (a folder, or
        tensors) and drop cached prefixes."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    def close(self) -> None: ...


class WeightStager(Protocol):
    """How updates are kept until loaded: ``WeightFolders`` (a folder per version) or
    ``WeightTensors`` (tensors in memory)."""

    model_dir: Path

    def write(self, weights: Mapping[str, torch.Tensor], version: int) -> Any:
        """Stage ``weights`` as ``version``; the result goes to ``SegmentBackend.load``."""
        ...

    def checksum(self, weights: Mapping[str, torch.Tensor]) -> float: ...

    def staged_checksum(self, version: int) -> float:
        """``checksum`` of what ``write`` staged for ``version`` (still staged: not yet released)."""
        ...

    def release_older(self, version: int) -> None:
        """Free what was staged for versions below ``version``."""
        ...

    def close(self) -> None: ...


@dataclass
class _Update:
    staged: Any
    version: int
    mode: WeightUpdateMode


@dataclass(eq=False)
class _Request:
    """One ``generate`` call: the tokens so far over all its segments."""

    request: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: int = 0
    live: str | None = None  # id of the running segment
    aborted: bool = False
    interrupted: bool = False


class SegmentedEngine:
    """Versioned generation and weight updates over a ``SegmentBackend`` (module docstring)."""

    def __init__(self, backend: SegmentBackend, folders: WeightStager, version: int = 0) -> None:
        self.backend = backend
        self.version = version
        self._folders = folders
        self._checksum: float | None = folders.checksum(folder_weights(folders.model_dir))
        self._requests: dict[str, _Request] = {}
        self._live: set[str] = set()
        self._gate_closed = False
        self._wake = asyncio.Event()
        self._pending: _Update | None = None
        self._pending_since = 0.0
        self._applier: asyncio.Task[None] | None = None
        self._failed: BaseException | None = None
        self._control: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._times = {"weight_drain_s": 0.0, "weight_load_s": 0.0, "version_activated_at": time.time()}
        names = ("generated_tokens", "reprefill_tokens", "weight_updates", "weight_updates_superseded")
        self._counts = dict.fromkeys(names, 0)

    async def generate(self, request: GenerationRequest) -> Completion:
        """Generate ``request`` (cancelling the await aborts it)."""
        _check(request)
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already in flight")
        state = self._requests[rid] = _Request(request)
        try:
            reason: FinishReason | None = None
            while reason is None:
                reason = await self._segment(state) if await self._admitted(state) else "abort"
            return Completion(rid, request.prompt_ids, *_tuples(state), reason)
        finally:
            del self._requests[rid]

    def abort(self, request_id: str) -> None:
        """A waiting request resolves at once, a running one as soon as the backend drops it."""
        state = self._requests.get(request_id)
        if state is None or state.aborted:
            return
        state.aborted = True
        if state.live is not None:
            self._spawn(self.backend.abort(state.live))
        self._notify()

    def pause(self) -> None:
        """Freeze scheduling in the backend; requests keep their place."""
        self._then(self.backend.pause)

    def resume(self) -> None:
        self._then(self.backend.resume)

    def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int, mode: WeightUpdateMode = "interrupt"
    ) -> None:
        """Stage ``weights`` as ``version`` (a tmpfs folder or tensors: the engine's stager) and
        load it in ``mode`` (module docstring); the load happens on the event loop, after this
        returns."""
        if mode not in _MODES:
            raise ValueError(f"unknown weight update mode {mode!r}; expected one of {_MODES}")
        staged = self._folders.write(weights, version)
        if self._pending is not None:
            self._counts["weight_updates_superseded"] += 1
        else:
            self._pending_since = time.perf_counter()
        self._pending = _Update(staged, version, mode)
        self._gate_closed = True
        if mode == "interrupt":
            for state in self._requests.values():
                if state.live is not None and not state.aborted:
                    state.interrupted = True
                    self._spawn(self.backend.abort(state.live))
        if self._applier is None or self._applier.done():
            self._applier = self._spawn(self._apply_updates())

    def stats(self) -> dict[str, float]:
        """Counters plus weight-sync state, named as ``HFInferenceEngine.stats`` names them;
        ``weight_drain_s`` is the time admission stood closed before each load (for ``interrupt``
        only the abort), ``weight_load_s`` the time the backend took to load."""
        pending = self._pending.version if self._pending is not None else -1
        running = len(self._live)
        values = {"running": running, "waiting": len(self._requests) - running, **self._counts, **self._times}
        return {name: float(v) for name, v in {**values, "version": self.version, "pending_version": pending}.items()}

    def weights_checksum(self) -> float:
        """The float64 sum of the weights last loaded (the model folder's, then each update's as
        staged), tied weights once; the backend's own parameters may be repacked and cannot be
        summed alike. Summed on first call per version, so a weight sync does not pay for it."""
        if self._checksum is None:
            self._checksum = self._folders.staged_checksum(self.version)
        return self._checksum

    def close(self) -> None:
        """Stop the backend and drop the staged weights (folders or tensors)."""
        self.backend.close()
        self._folders.close()

    async def _admitted(self, state: _Request) -> bool:
        """Wait while admission is closed (a weight update is pending); False once aborted."""
        while self._gate_closed and not state.aborted and self._failed is None:
            await self._wake.wait()
        if self._failed is not None:
            raise RuntimeError("weight update failed; the engine holds no consistent weights") from self._failed
        return not state.aborted

    async def _segment(self, state: _Request) -> FinishReason | None:
        """Run one segment for ``state`` under the current weights; None when a weight update
        interrupted it (the caller resubmits the rest)."""
        request, k = state.request, state.segments
        segment = Segment(
            segment_id=request.request_id if k == 0 else f"{request.request_id}#{k}",
            prompt_ids=(*request.prompt_ids, *state.tokens),
            request=request,
            max_tokens=request.params.max_new_tokens - len(state.tokens),
            seed=seed_key(request.seed * 1_000_003 + k),
        )
        version = self.version
        state.segments, state.live = k + 1, segment.segment_id
        self._live.add(segment.segment_id)
        if k:
            self._counts["reprefill_tokens"] += len(segment.prompt_ids)
        reason: str | None = None
        stream = self.backend.stream(segment)
        try:
            async for delta in stream:
                state.tokens += delta.token_ids
                state.logprobs += delta.logprobs
                state.versions += [version] * len(delta.token_ids)
                self._counts["generated_tokens"] += len(delta.token_ids)
                reason = delta.finish_reason
                if state.aborted:
                    break
        finally:
            await stream.aclose()  # stops the segment if it is still running
            state.live = None
            self._live.discard(segment.segment_id)
            self._notify()
        if state.aborted:
            return "abort"
        if state.interrupted and reason in (None, "abort"):
            state.interrupted = False
            return None
        if reason not in ("stop", "length"):
            raise RuntimeError(f"segment {segment.segment_id!r} ended with finish_reason {reason!r}")
        return reason  # type: ignore[return-value]

    async def _apply_updates(self) -> None:
        """Wait until no segment runs, then load the newest pending update; repeat while more come.
        A failed load fails every waiting request and every later one (the weights are unknown)."""
        try:
            while self._pending is not None:
                while self._live:
                    await self._wake.wait()
                update, self._pending = self._pending, None
                started = time.perf_counter()
                self._times["weight_drain_s"] += started - self._pending_since
                await self.backend.load(update.staged, update.version)
                self._times["weight_load_s"] += time.perf_counter() - started
                self._times["version_activated_at"] = time.time()
                logger.debug("weights v%d -> v%d (%s)", self.version, update.version, update.mode)
                self.version, self._checksum = update.version, None  # summed when asked: not on the sync path
                self._counts["weight_updates"] += 1
                self._folders.release_older(update.version)
                self._pending_since = time.perf_counter()
            self._gate_closed = False
        except Exception as err:
            self._failed = err
            raise
        finally:
            self._notify()

    def _notify(self) -> None:
        """Wake every coroutine waiting on admission, drain or abort (they re-check their condition)."""
        self._wake.set()
        self._wake = asyncio.Event()

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(_logged(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _then(self, call: Callable[[], Awaitable[Any]]) -> None:
        """Run control calls (pause, resume) one after another, in call order."""
        previous = self._control

        async def chained() -> None:
            if previous is not None:
                await previous
            await call()

        self._control = self._spawn(chained())


def _check(request: GenerationRequest) -> None:
    p = request.params
    if not request.prompt_ids:
        raise ValueError(f"request {request.request_id!r} has an empty prompt")
    if p.max_new_tokens < 1 or p.temperature < 0 or not 0 < p.top_p <= 1:
        raise ValueError(f"request {request.request_id!r}: invalid sampling params {p}")


def _tuples(state: _Request) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]:
    return tuple(state.tokens), tuple(state.logprobs), tuple(state.versions)


async def _logged(coro: Awaitable[Any]) -> Any:
    """Background engine calls: a failure is logged (nobody awaits the task) and re-raised."""
    try:
        return await coro
    except Exception:
        logger.exception("background engine call failed")
        raise
