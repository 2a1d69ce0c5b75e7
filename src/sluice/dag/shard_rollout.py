"""A rollout worker of a multi-controller run (``run.controller: multi``, DistFlow §5–6).

It runs its own loop: it takes admission credits from the run's ``StepGate`` (a small call, no
sample bytes), reads the prompts for them from its own shard of the dataset (``loader.py``: one
cursor per shard), generates, scores and writes each group into its step's queue partition, and
reports the group back to the gate (kept, or discarded by a named filter: the gate then grants
the slot again). The driver never sees a prompt or a row; it loads weights into this worker
between steps, as for any rollout worker. It decides nothing about admission: the gate does.
"""

from __future__ import annotations

import asyncio
from typing import Any

from sluice.api import AdmissionCredits, Credit, GroupReport, Partition, PromptItem
from sluice.dag.loader import PromptSource, ShardLoader
from sluice.rollout.worker import RolloutWorker


class RemoteCredits:
    """The run's ``StepGate`` actor, as the ``AdmissionCredits`` a worker calls."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate

    async def acquire(self, n: int) -> list[Credit]:
        return await self.gate.acquire.remote(n)  # type: ignore[no-any-return]

    async def report(self, report: GroupReport) -> None:
        await self.gate.report.remote(report)


class ShardRolloutWorker(RolloutWorker):
    """A ``RolloutWorker`` that admits its own groups from its own prompt shard."""

    loader: ShardLoader | None = None
    _running: set[int]

    async def run_shard(
        self,
        credits: AdmissionCredits,
        prompts: PromptSource,
        rank: int,
        size: int,
        *,
        seed: int,
        rows_per_step: int,
        per_call: int,
    ) -> dict[str, int]:
        """Generate groups for the gate's credits (``RemoteCredits``) until it grants no more;
        returns this shard's cursor. A failing wave ends the loop with its error (the driver's
        run stops on it)."""
        self.loader = ShardLoader(prompts, rank, size, seed)
        self._running = set()
        waves: set[asyncio.Task[None]] = set()
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        while True:
            asking = asyncio.ensure_future(credits.acquire(per_call))
            await asyncio.wait([asking, failed], return_when=asyncio.FIRST_COMPLETED)
            if failed.done():
                asking.cancel()
                failed.result()
            granted = asking.result()
            if not granted:
                break
            items: list[PromptItem] = self.loader.take(len(granted))
            wave = [(item, c.group_id) for item, c in zip(items, granted, strict=True)]
            parts = {c.group_id: Partition(c.step, rows_per_step) for c in granted}
            task = asyncio.ensure_future(self._wave(credits, wave, parts))
            task.add_done_callback(lambda t: _fail_on(t, failed))
            waves.add(task)
            task.add_done_callback(waves.discard)
        await asyncio.gather(*waves)
        return self.loader.cursor()

    async def _wave(
        self, credits: AdmissionCredits, wave: list[tuple[PromptItem, int]], parts: dict[int, Partition]
    ) -> None:
        self._running.update(gid for _, gid in wave)
        async for report in self.run_groups(wave, parts):
            self._running.discard(report.group_id)
            await credits.report(report)

    def stop_shard(self, reason: str = "run_end") -> int:
        """Abort the groups still generating (each reports ``reason``); returns how many."""
        running = sorted(getattr(self, "_running", ()))
        self.abort_groups(running, reason)
        return len(running)

    def shard_cursor(self) -> dict[str, int] | None:
        return self.loader.cursor() if self.loader is not None else None


def _fail_on(task: asyncio.Task[None], failed: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None and not failed.done():
        failed.set_exception(task.exception())  # type: ignore[arg-type]
