"""Supervision of a run's workers: heartbeats, the loop watchdog, and what a lost worker means.

``Watchdog.watch`` runs beside the training loop (``supervised``). It asks every supervised
worker for a heartbeat (a Ray actor answers in a concurrency group of its own, so a long train
step does not delay the answer: it answers with its CPU seconds) and reads the loop's progress;
a worker that has not answered, or a loop that has not moved while no worker computes (a long
train step is progress; a deadlock is not), for ``run.stall_timeout_s`` stops the run with
``WorkerStalled``: one line naming it. So does a loop asked to stop (SIGTERM / SIGINT,
``runtime/preemption.py``) that has not stopped ``run.stall_timeout_s`` later, busy or not: a
signal always ends the run in bounded time. A replaceable worker (the rollout worker) that stalls is killed instead, so
Ray restarts it and the loop regenerates its groups. A worker whose heartbeat finds it dead and
that cannot be replaced (a trainer rank, a queue-task worker) stops the run with ``WorkerDied``.

``WorkerLost`` is what a pipeline raises when a replaceable worker died under a wave of groups:
the loop awaits its ``recover`` (the replacement holds the current weights) and starts the
wave's unreported groups again, counted as regenerated.

``Answers`` keeps when each worker last answered its heartbeat, so that a teardown does not wait
for a worker found silent (a stopped actor never answers its close call either).

Not here: restarting actors (Ray's ``max_restarts``), re-syncing weights (the pipeline) or
regenerating groups (``controller/loop.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from sluice.schedule.failures import RunStopped

log = logging.getLogger(__name__)
T = TypeVar("T")
RESUME_HINT = "resume=auto continues this run from its last checkpoint"
BUSY_SHARE = 0.25
"""A worker using at least this share of a core is working (an idle one uses ~1 %)."""
FIRST_ANSWER_S = 180.0
"""How long a worker has to answer its first heartbeat, if ``run.stall_timeout_s`` is shorter: a
Ray actor answers nothing until its constructor returns (its process, imports, a model load),
which on a busy machine can take longer than a short stall timeout."""


class WorkerDied(RunStopped):
    """A worker that cannot be replaced died: the run stops (one line: which, why, how to go on)."""

    def __init__(self, worker: str, detail: str) -> None:
        super().__init__(f"the {worker} died ({detail}); {RESUME_HINT}")
        self.worker = worker


class WorkerStalled(RunStopped):
    """A worker sent no heartbeat, or the loop made no progress, for ``run.stall_timeout_s``."""

    def __init__(self, worker: str, seconds: float, what: str) -> None:
        super().__init__(f"the {worker} {what} for {seconds:.0f} s (stopped or hung); {RESUME_HINT}")
        self.worker = worker


class WorkerLost(Exception):
    """A replaceable worker died under a wave: ``groups`` (ids) were not reported; ``recover``
    waits for its replacement to hold the current weights."""

    def __init__(self, worker: str, groups: Sequence[int], recover: Callable[[], Awaitable[None]]) -> None:
        super().__init__(f"the {worker} died with {len(groups)} groups unreported")
        self.worker = worker
        self.groups = list(groups)
        self.recover = recover


@dataclass(frozen=True)
class Heartbeat:
    """One supervised worker: ``ping`` answers while it lives; ``dead`` tells a ping's error that
    means it died (``None``: any other error is a transient one); ``replace`` (a replaceable
    worker) kills it so that it is restarted, instead of stopping the run."""

    worker: str
    ping: Callable[[], Awaitable[object]]
    dead: Callable[[BaseException], str | None]
    replace: Callable[[], Awaitable[None]] | None = None


class Answers:
    """When each supervised worker last answered its heartbeat (``timed`` wraps its ping): a
    pipeline's teardown asks which went ``silent`` and waits for none of those (a stopped actor
    answers no close call; each such wait ran to its timeout, per restart of a run)."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def timed(self, worker: str, ping: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[object]]:
        """``ping``, recording when it answers."""

        async def answered() -> object:
            answer = await ping()
            self._at[worker] = time.monotonic()
            return answer

        return answered

    def silent(self, timeout_s: float) -> set[str]:
        """Workers that answered once and not for more than ``timeout_s`` since (a worker still
        starting has answered nothing: not silent; ``timeout_s`` <= 0: no watchdog, none)."""
        if timeout_s <= 0:
            return set()
        now = time.monotonic()
        return {worker for worker, at in self._at.items() if now - at > timeout_s}


class Watchdog:
    """Stops the run when a worker or the loop goes silent for ``timeout_s`` (see the module)."""

    def __init__(
        self,
        timeout_s: float,
        beats: Sequence[Heartbeat],
        progress: Callable[[], Hashable],
        stop_asked: Callable[[], float | None] = lambda: None,
        first_answer_s: float = FIRST_ANSWER_S,
    ) -> None:
        self.timeout_s = timeout_s
        self.first_answer_s = max(timeout_s, first_answer_s)
        """How long a worker has to answer its first heartbeat."""
        self.beats = list(beats)
        self.progress = progress
        self.stop_asked = stop_asked
        """When (``time.monotonic``) a stop was asked (SIGTERM / SIGINT), else ``None``: the loop
        has ``timeout_s`` from then to stop, however busy its workers are."""
        self.interval_s = min(5.0, timeout_s / 4)
        self.replaced: dict[str, int] = {}
        """Stalled replaceable workers killed, by worker."""
        self._heard: dict[str, float] = {}
        self._answered: set[str] = set()
        """Workers that answered a heartbeat (the others have ``FIRST_ANSWER_S``)."""
        self._failure: RunStopped | None = None
        self._paused = 0
        self._moved = 0.0
        """When the loop last moved (or was paused, a worker worked, or one was replaced)."""
        self._cpu: dict[str, float] = {}
        """Each worker's CPU seconds, as its last heartbeat said."""
        self._cpu_seen: dict[str, float] = {}
        self._looked = time.monotonic()
        self._replacing: set[str] = set()
        """Workers killed to be replaced that have not answered since."""

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The loop is busy on purpose (an evaluation, a checkpoint): its progress is not judged."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    async def watch(self) -> None:
        """Runs until it raises ``WorkerStalled`` / ``WorkerDied`` (cancel it when the loop ends)."""
        now = time.monotonic()
        self._heard = {beat.worker: now for beat in self.beats}
        pingers = [asyncio.create_task(self._listen(beat)) for beat in self.beats]
        self._moved, seen = now, self.progress()
        try:
            while self._failure is None:
                await asyncio.sleep(self.interval_s)
                now = time.monotonic()
                current = self.progress()
                if self._paused or current != seen or self._working(now):
                    self._moved, seen = now, current
                for beat in self.beats:
                    limit = self.timeout_s if beat.worker in self._answered else self.first_answer_s
                    if now - self._heard[beat.worker] > limit:
                        await self._silent(beat, now)
                # every worker answers, yet nothing moves: the loop itself hangs (a silent worker
                # gets its own verdict, naming it)
                answering = not self._replacing and all(now - t <= 2 * self.interval_s for t in self._heard.values())
                if self._failure is None and answering and now - self._moved > self.timeout_s:
                    self._failure = WorkerStalled("training loop", now - self._moved, "made no progress")
                asked = self.stop_asked()
                if self._failure is None and asked is not None and now - asked > self.timeout_s:
                    self._failure = WorkerStalled("training loop", now - asked, "did not stop when asked to")
            raise self._failure
        finally:
            for task in pingers:
                task.cancel()

    def _working(self, now: float) -> bool:
        """Whether a worker (or this process: the local backend's trainer thread) spent at least
        ``BUSY_SHARE`` of a core since the last look: a long train step is progress too, a
        deadlock is not."""
        cpu = {**self._cpu, "": time.process_time()}
        busy = any(cpu[k] - self._cpu_seen.get(k, cpu[k]) >= BUSY_SHARE * (now - self._looked) for k in cpu)
        self._cpu_seen, self._looked = cpu, now
        return busy

    async def _listen(self, beat: Heartbeat) -> None:
        """Ping ``beat`` every interval (its answer: the worker's CPU seconds); a dead,
        irreplaceable worker stops the run at once."""
        while True:
            try:
                answer = await beat.ping()
                self._heard[beat.worker] = time.monotonic()
                self._answered.add(beat.worker)
                if beat.worker in self._replacing:  # replaced: the loop gets a whole timeout to move again
                    self._replacing.discard(beat.worker)
                    self._moved = self._heard[beat.worker]
                if isinstance(answer, float):
                    self._cpu[beat.worker] = answer
            except asyncio.CancelledError:
                raise
            except Exception as err:  # deliberate: a ping's error is judged, not propagated
                detail = beat.dead(err)
                if detail is None and beat.replace is not None:
                    self._replacing.add(beat.worker)  # unavailable: being restarted
                elif detail is not None and beat.replace is None:
                    self._failure = WorkerDied(beat.worker, detail)
                    return
            await asyncio.sleep(self.interval_s)

    async def _silent(self, beat: Heartbeat, now: float) -> None:
        silent = now - self._heard[beat.worker]
        if beat.replace is None:
            self._failure = WorkerStalled(beat.worker, silent, "sent no heartbeat")
            return
        if beat.worker in self._replacing:
            return  # its replacement is starting (the pipeline's recovery bounds how long)
        log.warning("the %s sent no heartbeat for %.0f s: killed, to be replaced", beat.worker, silent)
        self.replaced[beat.worker] = self.replaced.get(beat.worker, 0) + 1
        self._replacing.add(beat.worker)
        self._moved = now
        await beat.replace()


async def supervised(work: Awaitable[T], watchdog: Watchdog | None) -> T:
    """``await work``, unless ``watchdog`` stops the run first (then ``work`` is cancelled)."""
    if watchdog is None:
        return await work
    running = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(watchdog.watch())
    try:
        await asyncio.wait([running, watching], return_when=asyncio.FIRST_COMPLETED)
        if watching.done() and not running.done():
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            watching.result()  # raises the stop
        return await running
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)


def abandon(future: asyncio.Future[object]) -> None:
    """Cancel ``future`` (a gather nobody will await once its awaiter stopped) and take its outcome
    when it comes, so that asyncio never prints ``exception was never retrieved`` after the run's
    one line."""
    if not future.done():
        future.cancel()
    future.add_done_callback(lambda done: done.cancelled() or done.exception())
