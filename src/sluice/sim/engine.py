"""``SimEngine``: an ``InferenceEngine`` whose generation costs simulated time, not compute.

It reproduces what makes rollout scheduling matter (DESIGN.md "Simulation is a product
feature") so benchmarks and the planner can drive the real rollout, LLMProxy and controller code:
a decode iteration advances every running sequence by one token in
``decode_s · max(1, running / knee)`` simulated seconds (StreamRL Fig. 6's per-token latency
curve) for at most ``max_running`` sequences (the rest wait, FIFO); admitting costs
``prefill_s_per_token`` per prompt token (same-prompt requests share one prefill); response
lengths come from ``LengthModel`` (log-normal, long-tailed, a factor shared by a prompt's samples,
or measured prompt lengths); every token carries its version, and ``update_weights`` follows the
built-in engine's modes with a ``load_s`` stall (docs/rollout.md, "Simulation").

Tokens, lengths and log-probs are pure functions of (request seed, prompt, version), so outputs
are deterministic; timing is deterministic too on ``sim.clock.run_virtual``'s virtual clock.
``time_scale`` maps simulated seconds to event-loop seconds (1: the loop's clock is the
simulated clock). The engine decodes nothing and ignores the weights' values.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import random
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice.api.protocols import WeightUpdateMode
from sluice.api.types import Completion, FinishReason, GenerationRequest
from sluice.rollout.single_turn import sample_seed

_MODES = ("interrupt", "defer", "staggered")


@dataclass(frozen=True)
class LengthModel:
    """Response length ``median · exp(prompt_sigma · z_p + sample_sigma · z_s)`` tokens, at least
    ``min_tokens``: ``z_p ~ N(0, 1)`` from the prompt's tokens (shared by a prompt's samples),
    ``z_s ~ N(0, 1)`` from the request seed. The defaults give p99 / p50 ≈ 20 (ROLL Flash's long
    tail) with most of the spread between prompts.

    With ``prompt_lengths`` (a measured distribution of prompts' typical lengths, e.g. a task
    whose prompts come in a short and a long kind, which no log-normal fits), a prompt's length is
    that distribution's quantile at ``Φ(z_p)`` instead of ``median · exp(prompt_sigma · z_p)``;
    the per-sample spread still applies."""

    median: float = 256.0
    prompt_sigma: float = 1.0
    sample_sigma: float = 0.8
    min_tokens: int = 1
    seed: int = 0
    prompt_lengths: tuple[float, ...] = ()
    """Sorted typical lengths of measured prompts (empirical quantiles); empty: log-normal."""

    def prompt_z(self, prompt_ids: Sequence[int]) -> float:
        digest = hashlib.blake2b(repr((self.seed, tuple(prompt_ids))).encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(digest, "little")).gauss(0.0, 1.0)

    def prompt_log_length(self, prompt_ids: Sequence[int]) -> float:
        """The log of a prompt's typical length (before the per-sample spread)."""
        z = self.prompt_z(prompt_ids)
        if not self.prompt_lengths:
            return math.log(self.median) + self.prompt_sigma * z
        at = int(statistics.NormalDist().cdf(z) * len(self.prompt_lengths))
        return math.log(self.prompt_lengths[min(at, len(self.prompt_lengths) - 1)])

    def length(self, prompt_ids: Sequence[int], seed: int) -> int:
        z_sample = random.Random(sample_seed(self.seed, seed, 0)).gauss(0.0, 1.0)
        log_len = self.prompt_log_length(prompt_ids) + self.sample_sigma * z_sample
        return max(self.min_tokens, round(math.exp(log_len)))


@dataclass(frozen=True)
class SimEngineConfig:
    """Cost model of one simulated replica (times in simulated seconds)."""

    decode_s: float = 0.02
    """One decode iteration while the running batch is at or below ``knee``."""
    knee: int = 32
    """Running batch above which an iteration's time grows linearly with the batch."""
    max_running: int = 128
    """Sequences decoded together (the KV budget); later requests wait."""
    prefill_s_per_token: float = 2e-5
    """Prefill (and interrupt re-prefill) time per prompt token."""
    load_s: float = 0.5
    """Time the engine stands still to load new weights."""
    vocab: int = 32000
    time_scale: float = 1.0
    """Event-loop seconds per simulated second (1 on the virtual clock; e.g. 0.01 in real time)."""
    lengths: LengthModel = LengthModel()

    def iteration_s(self, running: int) -> float:
        return self.decode_s * max(1.0, running / self.knee)


@dataclass(eq=False)
class _SimSeq:
    request: GenerationRequest
    future: asyncio.Future[Completion]
    target: int
    reason: FinishReason
    versions: list[int] = field(default_factory=list)

    @property
    def left(self) -> int:
        return self.target - len(self.versions)


@dataclass
class _Update:
    version: int
    mode: str
    drain_since: float | None  # simulated time admission stopped for it (None: interrupt)


class SimEngine:
    """A simulated continuous-batching inference engine (see the module docstring)."""

    def __init__(self, config: SimEngineConfig | None = None, *, version: int = 0) -> None:
        self.config = config or SimEngineConfig()
        self.version = version
        self._waiting: deque[_SimSeq] = deque()
        self._running: list[_SimSeq] = []
        self._by_id: dict[str, _SimSeq] = {}
        self._abort_ids: set[str] = set()
        self._update: _Update | None = None
        self._paused = False
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None
        self._activated_at = 0.0
        self.update_windows: list[tuple[float, float]] = []
        """(start, end) simulated times this engine admitted nothing because of a weight update:
        from a staged update's arrival (or an interrupt's stall) to the end of its load."""
        names = ("generated_tokens", "prefill_tokens", "reprefill_tokens", "steps", "weight_updates")
        self._counts: dict[str, float] = dict.fromkeys((*names, "weight_updates_superseded"), 0)
        self._times = dict.fromkeys(("busy_s", "weight_load_s", "weight_drain_s"), 0.0)

    @staticmethod
    def tokens(seed: int, count: int, vocab: int) -> tuple[int, ...]:
        """The first ``count`` tokens a request with ``seed`` emits (a prefix never changes)."""
        return tuple(np.random.default_rng(sample_seed(seed, 0, 1)).integers(0, vocab, count).tolist())

    @staticmethod
    def behaviour_logprobs(seed: int, versions: Sequence[int]) -> tuple[float, ...]:
        """The log-probs reported for tokens sampled by weights ``versions[i]`` at position ``i``:
        each version has its own stream, so they depend on the weights that sampled each token."""
        at = np.asarray(versions, dtype=np.int64)
        out = np.empty(len(at))
        for v in np.unique(at).tolist():
            stream = -0.05 - 4.0 * np.random.default_rng(sample_seed(seed, v, 2)).random(len(at))
            out[at == v] = stream[at == v]
        return tuple(out.tolist())

    async def generate(self, request: GenerationRequest) -> Completion:
        """Queue ``request`` and await it (cancelling the await aborts it)."""
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        if request.params.max_new_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_new_tokens must be >= 1")
        planned = self.config.lengths.length(request.prompt_ids, request.seed)
        cap = request.params.max_new_tokens
        seq = _SimSeq(request, asyncio.get_running_loop().create_future(), min(planned, cap),
                      "stop" if planned <= cap else "length")  # fmt: skip
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        self._ensure_driver()
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    def abort(self, request_id: str) -> None:
        """A waiting request resolves now; a running one when the current iteration ends."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return
        if seq in self._waiting:
            self._waiting.remove(seq)
            self._resolve(seq, "abort")
        else:
            self._abort_ids.add(request_id)
            self._wake_driver()

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake_driver()

    def update_weights(self, weights: Mapping[str, Any], version: int, mode: WeightUpdateMode = "interrupt") -> None:
        """Take ``version`` in ``mode``; applied at the next iteration boundary (at once when no
        event loop runs). A newer update replaces one still pending."""
        if mode not in _MODES:
            raise ValueError(f"unknown weight update mode {mode!r}; expected one of {_MODES}")
        since = self._update.drain_since if self._update is not None else None
        if self._update is not None:
            self._counts["weight_updates_superseded"] += 1
        if since is None and mode != "interrupt":
            since = self._now()
        self._update = _Update(version, mode, since)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop: nothing can be running either
            self._update = None
            self._activate(version)
            return
        self._ensure_driver()

    def stats(self) -> dict[str, float]:
        """Counters plus weight-sync state (as ``HFInferenceEngine``), and simulated seconds spent
        decoding (``busy_s``), stalled loading weights (``weight_load_s``) and with admission stopped
        for a staged update (``weight_drain_s``)."""
        pending = self._update.version if self._update is not None else -1
        return {
            "running": float(len(self._running)),
            "waiting": float(len(self._waiting)),
            **self._counts,
            **self._times,
            "version": float(self.version),
            "pending_version": float(pending),
            "version_activated_at": self._activated_at,
        }

    def weights_checksum(self) -> float:
        """A simulated engine holds no weights: its version stands for them."""
        return float(self.version)

    def _now(self) -> float:
        try:
            return asyncio.get_running_loop().time() / self.config.time_scale
        except RuntimeError:
            return 0.0

    async def _sleep(self, sim_seconds: float) -> None:
        if sim_seconds > 0:
            await asyncio.sleep(sim_seconds * self.config.time_scale)

    def _has_work(self) -> bool:
        return bool(self._waiting or self._running or self._update)

    def _ensure_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._wake = asyncio.Event()
            self._driver = asyncio.get_running_loop().create_task(self._drive(self._wake))
        self._wake_driver()

    def _wake_driver(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _drive(self, wake: asyncio.Event) -> None:
        while self._has_work():
            await self._boundary(wake)
            if self._running and not self._paused:
                await self._decode(wake)
            elif self._has_work():  # paused: wait for news
                await wake.wait()

    async def _boundary(self, wake: asyncio.Event) -> None:
        """Between iterations: drop aborted rows, apply or stage a weight update, admit. News
        arriving from here on (even during a stall) sets ``wake`` again."""
        wake.clear()
        if self._abort_ids:
            for seq in [s for s in self._running if s.request.request_id in self._abort_ids]:
                self._running.remove(seq)
                self._resolve(seq, "abort")
            self._abort_ids.clear()
        update = self._update
        if update is not None and (update.mode == "interrupt" or not self._running):
            self._update = None
            start = self._now() if update.drain_since is None else update.drain_since
            self._times["weight_drain_s"] += self._now() - start
            await self._stall(self.config.load_s)
            if update.mode == "interrupt" and self._running:
                tokens = sum(len(s.request.prompt_ids) + len(s.versions) for s in self._running)
                self._counts["reprefill_tokens"] += tokens
                await self._stall(tokens * self.config.prefill_s_per_token)
            self._activate(update.version)
            self.update_windows.append((start, self._now()))
        if not self._paused and self._update is None:
            await self._admit()

    async def _stall(self, sim_seconds: float) -> None:
        self._times["weight_load_s"] += sim_seconds
        await self._sleep(sim_seconds)

    def _activate(self, version: int) -> None:
        self.version = version
        self._counts["weight_updates"] += 1
        self._activated_at = self._now()

    async def _admit(self) -> None:
        free = self.config.max_running - len(self._running)
        new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        if not new:
            return
        tokens = sum(len(p) for p in {s.request.prompt_ids for s in new})
        self._counts["prefill_tokens"] += tokens
        self._running += new
        await self._sleep(tokens * self.config.prefill_s_per_token)

    async def _decode(self, wake: asyncio.Event) -> None:
        """Decode until the first running sequence finishes or news arrives (then finish the
        iteration in progress): every row gains the same number of tokens."""
        batch = len(self._running)
        step = self.config.iteration_s(batch)
        most = min(s.left for s in self._running)
        start = self._now()
        with contextlib.suppress(TimeoutError):  # the first finish, unless news comes first
            await asyncio.wait_for(wake.wait(), most * step * self.config.time_scale)
        elapsed = self._now() - start
        done = min(most, int(elapsed / step + 1e-9))
        if done < most:  # woken inside an iteration: it completes before anything changes
            await self._sleep((done + 1) * step - elapsed)
            done += 1
        self._times["busy_s"] += done * step
        self._counts["steps"] += done
        self._counts["generated_tokens"] += done * batch
        for seq in self._running:
            seq.versions += [self.version] * done
        finished = [s for s in self._running if s.left == 0]
        self._running = [s for s in self._running if s.left > 0]
        for seq in finished:
            self._resolve(seq, seq.reason)

    def _resolve(self, seq: _SimSeq, reason: FinishReason) -> None:
        request = seq.request
        self._by_id.pop(request.request_id, None)
        if seq.future.done():
            return
        vocab, seed = self.config.vocab, request.seed
        tokens = self.tokens(seed, len(seq.versions), vocab)
        logprobs = self.behaviour_logprobs(seed, seq.versions)
        seq.future.set_result(
            Completion(request.request_id, request.prompt_ids, tokens, logprobs, tuple(seq.versions), reason)
        )
