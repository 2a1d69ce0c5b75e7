"""The training loop of every run: train a step, bump the version, sync the weights, log.

It reads as the algorithm; an admission strategy decides which groups start and where a step's
rows come from, the pipeline does the work:

    for each step v: the step's groups into the trainer → optimizer step (v → v+1) → weight sync
      to the engines (in the background; admission opens for v+1 once the engines hold it) → log

Two strategies fill a step: ``PushAdmission`` (``push.py``, ``run.controller: single``: the
driver admits groups in waves and streams the chosen ones into the trainer) and
``PullAdmission`` (``multi.py``, ``run.controller: multi``: rollout workers pull credits from a
gate actor and each trainer rank reads its partition of the step). Both ask the one staleness
rule (``schedule/``). ``run.mode: async`` overlaps generation, training and weight syncs under
the staleness bound η; ``run.mode: sync`` is the same loop with ``barrier`` at η = 0: a step
trains only once none of its groups is generating, and the engines load v + 1 before the step
is reported. The driver only moves group ids, versions and counters; sample data goes rollout →
queue → trainer directly. Both schedules compute the same steps (the golden-loss test).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from sluice.api import GroupReport
from sluice.controller.cut import AsyncCut
from sluice.schedule.ledger import GroupLedger

StepCallback = Callable[[int, list[int], dict[str, float]], Awaitable[bool]]


class SyncsWeights(Protocol):
    """What the loop itself asks of the pipeline: the engines' version, and a weight sync."""

    engine_version: int

    async def sync_weights(self, version: int) -> dict[str, float]: ...


class Admission(Protocol):
    """How groups are admitted and how a step gets its rows (``push.py``, ``multi.py``)."""

    ledger: GroupLedger
    reports: dict[int, GroupReport]
    """Reports of the groups the step being logged trained (and others, untrained)."""
    barrier: bool
    """The ``sync`` schedule: the engines load v + 1 before the step is reported."""
    reported: int
    """Group reports so far (a sign of life; 0 where workers report to a gate)."""

    async def start(self, steps: int) -> None: ...

    async def train_step(self, version: int) -> tuple[list[int], dict[str, float]]:
        """Step ``version``'s groups through the trainer and its optimizer step: (their ids, metrics)."""
        ...

    def logged(self, chosen: list[int]) -> None: ...

    async def before_sync(self, version: int) -> bool:
        """Wait until the engines may load ``version``; True when the whole sync is exposed."""
        ...

    def opened(self) -> None:
        """The engines hold a new version."""
        ...

    async def stop(self, failed: bool) -> None: ...

    async def cut(self) -> AsyncCut: ...

    async def resume(self, cut: AsyncCut, version: int) -> None: ...


class Controller:
    """Runs ``steps`` training steps over a pipeline, its groups admitted by ``admission``."""

    def __init__(self, pipeline: SyncsWeights, admission: Admission) -> None:
        self.pipeline = pipeline
        self.admission = admission
        self.version = pipeline.engine_version
        self.sync_metrics: dict[str, float] = {}
        """Timings of the most recent completed weight sync."""
        self._sync: asyncio.Task[None] | None = None

    @property
    def ledger(self) -> GroupLedger:
        return self.admission.ledger

    @property
    def reports(self) -> dict[int, GroupReport]:
        return self.admission.reports

    async def run(self, steps: int, after_step: StepCallback) -> None:
        await self.admission.start(steps)
        try:
            while self.version < steps:
                chosen, metrics = await self._train_step()  # optimizer step: v -> v + 1
                self.version += 1
                await self._await_sync()  # one weight sync in flight at a time
                self._sync = asyncio.create_task(self._sync_weights(self.version, metrics.get("weights_checksum")))
                if self.admission.barrier:  # sync: the engines hold v + 1 before anything else happens
                    await self._await_sync()
                keep_going = await after_step(self.version, chosen, metrics)
                self.admission.logged(chosen)
                if not keep_going:
                    break
            await self._await_sync()
        except BaseException:
            if self._sync is not None:
                self._sync.cancel()
            await self.admission.stop(failed=True)
            raise
        await self.admission.stop(failed=False)

    async def _train_step(self) -> tuple[list[int], dict[str, float]]:
        """The admission's next step, or the running weight sync's error as soon as it fails (a
        step waiting for groups of the new version would otherwise wait for the stall watchdog)."""
        step = asyncio.ensure_future(self.admission.train_step(self.version))
        sync = self._sync
        try:
            if sync is not None:
                await asyncio.wait({step, sync}, return_when=asyncio.FIRST_COMPLETED)
                if sync.done() and not sync.cancelled() and sync.exception() is not None and not step.done():
                    await sync  # raises its error (the step is cancelled below)
            return await step
        except BaseException:
            step.cancel()  # a cancelled run (the watchdog) or a failed sync: no orphaned step
            await asyncio.gather(step, return_exceptions=True)
            raise

    def progress(self) -> tuple[int, int]:
        """(policy version, groups reported): changes whenever the loop moves."""
        return self.version, self.admission.reported

    async def _sync_weights(self, version: int, published: float | None = None) -> None:
        """Engines load ``version``. Exposed time: the worker's fetch + load (generation stalls
        for it), or the whole sync when admission had no credit left at the old version.
        ``published``: the trainer's checksum of ``version`` (``run.check_weights``), which the
        engines' must equal."""
        starved = await self.admission.before_sync(version)
        started = time.monotonic()
        metrics = await self.pipeline.sync_weights(version)
        held = metrics.get("engine_checksum")
        if published is not None and held is not None and held != published:
            raise RuntimeError(
                f"run.check_weights: after loading version {version} the engines hold weights with checksum "
                f"{held!r}, the trainer published {published!r}"
            )
        took = time.monotonic() - started
        stalled = metrics.get("weight_fetch_s", 0.0) + metrics.get("weight_load_s", 0.0)
        self.sync_metrics = {**metrics, "weight_sync_s": took, "exposed_weight_sync_s": took if starved else stalled}
        if published is not None and held is not None:
            self.sync_metrics["weights_checked_version"] = float(version)
        self.admission.opened()

    async def _await_sync(self) -> None:
        if self._sync is not None:
            await self._sync
            self._sync = None
