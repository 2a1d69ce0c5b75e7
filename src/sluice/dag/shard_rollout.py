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
from collections.abc import Sequence
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
    _admitted: dict[int, tuple[int, PromptItem, dict[str, int]]]
    """Each group granted and not yet known trained: its step, prompt, and the cursor after it."""
    _base_cursor: dict[str, int]

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
        cursor: dict[str, int] | None = None,
        regenerate: Sequence[tuple[PromptItem, Credit]] = (),
    ) -> dict[str, int]:
        """Generate groups for the gate's credits (``RemoteCredits``) until it grants no more;
        returns this shard's cursor. A resumed run gives the shard's ``cursor`` at the checkpoint
        and the groups to ``regenerate`` (granted before it, still generating at it). A failing
        wave ends the loop with its error (the driver's run stops on it)."""
        self.loader = ShardLoader(prompts, rank, size, seed)
        if cursor is not None:
            self.loader.restore(cursor)
        self._running, self._admitted, self._base_cursor = set(), {}, self.loader.cursor()
        waves: set[asyncio.Task[None]] = set()
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def start(wave: list[tuple[PromptItem, int]], parts: dict[int, Partition]) -> None:
            task = asyncio.ensure_future(self._wave(credits, wave, parts))
            task.add_done_callback(lambda t: _fail_on(t, failed))
            waves.add(task)
            task.add_done_callback(waves.discard)

        if regenerate:  # their prompts were taken before the checkpoint's cursor
            self._admitted.update((c.group_id, (c.step, item, self._base_cursor)) for item, c in regenerate)
            again = [c for _, c in regenerate]
            start([(item, c.group_id) for item, c in regenerate], self._partitions(again, rows_per_step))
        while True:
            asking = asyncio.ensure_future(credits.acquire(per_call))
            await asyncio.wait([asking, failed], return_when=asyncio.FIRST_COMPLETED)
            if failed.done():
                asking.cancel()
                failed.result()
            granted = asking.result()
            if not granted:
                break
            self._forget_trained(min(c.version for c in granted))  # v: every step before it is trained
            wave = []
            for credit in granted:  # a prompt each, remembered until the group's step is trained
                (item,) = self.loader.take(1)
                self._admitted[credit.group_id] = (credit.step, item, self.loader.cursor())
                wave.append((item, credit.group_id))
            start(wave, self._partitions(granted, rows_per_step))
        await asyncio.gather(*waves)
        return self.loader.cursor()

    @staticmethod
    def _partitions(credits: Sequence[Credit], rows_per_step: int) -> dict[int, Partition]:
        return {c.group_id: Partition(c.step, rows_per_step) for c in credits}

    def checkpoint_cut(
        self, next_group: int, trained_steps: int, pending: Sequence[int]
    ) -> tuple[dict[str, int], dict[int, PromptItem]]:
        """This shard at a checkpoint's cut of the gate (every group id below ``next_group`` was
        granted before it): the cursor just after the prompt of its last group granted before the
        cut (a later one's prompt is taken again on resume), and the prompts of the ``pending``
        groups it generates. Prompts of groups of steps already trained are forgotten here."""
        self._forget_trained(trained_steps)
        before = [cursor for gid, (_, _, cursor) in self._admitted.items() if gid < next_group]
        cursor = max([self._base_cursor, *before], key=_place)
        prompts = {gid: self._admitted[gid][1] for gid in pending if gid in self._admitted}
        return cursor, prompts

    async def _wave(
        self, credits: AdmissionCredits, wave: list[tuple[PromptItem, int]], parts: dict[int, Partition]
    ) -> None:
        self._running.update(gid for _, gid in wave)
        async for report in self.run_groups(wave, parts):
            self._running.discard(report.group_id)
            await credits.report(report)

    def _forget_trained(self, trained_steps: int) -> None:
        """Drop the groups of steps already trained (no cut can find them generating), keeping
        the newest of their cursors: what this worker remembers stays about (η + 1) steps."""
        for gid in [g for g, (step, _, _) in self._admitted.items() if step < trained_steps]:
            self._base_cursor = max(self._base_cursor, self._admitted.pop(gid)[2], key=_place)

    def stop_shard(self, reason: str = "run_end") -> int:
        """Abort the groups still generating (each reports ``reason``); returns how many."""
        running = sorted(getattr(self, "_running", ()))
        self.abort_groups(running, reason)
        return len(running)


def _place(cursor: dict[str, int]) -> tuple[int, int]:
    return cursor["epoch"], cursor["position"]


def _fail_on(task: asyncio.Task[None], failed: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None and not failed.done():
        failed.set_exception(task.exception())  # type: ignore[arg-type]
