"""Push admission: the driver admits groups in waves and streams each step's chosen groups into
the trainer (``run.controller: single``, both modes).

    admit groups while the gate has credit (plus redundant ones) → each rollout generates, scores
      and writes its group; once the quota is met, surplus groups still generating are aborted
    for step v: take groups (oldest ready first, waiting for old ones still generating when the
      staleness deadlines need them) and stream them into the trainer → optimizer step

The ledger keeps the books and the staleness rule (``schedule/``); the pipeline does the work.
With ``barrier`` (``run.mode: sync``) a step trains only once none of its groups is generating.
Each step's metrics say how long it waited for generation (``step_wait_generation_s``, the
trainer's idle share) and how long it spent in the trainer's calls (``step_train_s``).
Every reported group also goes to the run's ``FailureBudget``: a reward or environment over
budget stops admission and ends the run with its one-line ``RunStopped`` error. It runs no loop
over versions (``loop.py`` does) and syncs no weights.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from sluice.api import GroupReport, PromptItem
from sluice.controller.cut import AsyncCut
from sluice.runtime.supervision import WorkerLost
from sluice.schedule.failures import FailureBudget, RunStopped
from sluice.schedule.ledger import GroupLedger, GroupState


class Pipeline(Protocol):
    """What push admission drives (``runtime/pipelines.py`` builds local and Ray ones)."""

    engine_version: int
    """The policy version every engine holds now."""

    def next_prompt(self) -> PromptItem: ...

    def rollout_wave(self, groups: Sequence[tuple[PromptItem, int]]) -> AsyncIterator[GroupReport]:
        """Generate, score and store a wave of groups started together; report each as it ends."""
        ...

    async def abort_groups(self, group_ids: list[int], reason: str) -> None:
        """Stop these groups still generating; each is reported (discarded, ``reason``) by its wave."""
        ...

    async def begin_step(self) -> None: ...

    async def train_groups(self, group_ids: list[int]) -> None:
        """Stream these groups (in this order) into the current step's gradient accumulation."""
        ...

    async def finish_step(self) -> dict[str, float]: ...

    async def sync_weights(self, version: int) -> dict[str, float]: ...


class PushAdmission:
    """The driver's waves over a ``Pipeline``: ``steps`` steps of ``groups_per_step`` groups."""

    def __init__(
        self,
        pipeline: Pipeline,
        ledger: GroupLedger,
        groups_per_step: int,
        *,
        barrier: bool = False,
        failures: FailureBudget | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.ledger = ledger
        self.groups_per_step = groups_per_step
        self.barrier = barrier
        """The ``sync`` schedule: a step trains only once no group is generating."""
        self.failures = failures
        """Judges every reported group; ``None``: failures never stop the run."""
        self.reports: dict[int, GroupReport] = {}
        """Reports of the finished groups not yet trained, and of the step's groups until it is
        logged (``logged``); then they are dropped, so a long run holds a bounded number."""
        self.reported = 0
        """Group reports received (the watchdog's sign of life)."""
        self._next_group = 0
        self._generating: dict[int, PromptItem] = {}
        """Prompts of groups admitted and not yet reported (a checkpoint restarts them)."""
        self._news = asyncio.Event()
        self._reported = asyncio.Event()
        """Set on every group report and failure; the weight sync's own wake-up (``forced_lag``)."""
        self._rollouts: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        self._budget: int | None = None
        """Groups the run can ever train (its steps' quota plus the redundant ones); ``None``: no cap."""

    async def start(self, steps: int) -> None:
        self._budget = steps * self.groups_per_step + self.ledger.redundant_groups
        self._admit()

    async def train_step(self, version: int) -> tuple[list[int], dict[str, float]]:
        """Stream ``groups_per_step`` groups into the trainer as they are ready, then its
        optimizer step (``version → version + 1``)."""
        started = time.monotonic()
        await self.pipeline.begin_step()
        chosen: list[int] = []
        waited = 0.0  # the trainer had nothing to do: the step waited for generation
        while len(chosen) < self.groups_per_step:
            self._raise_failure()
            generating = self.barrier and self.ledger.in_flight > 0
            batch = [] if generating else self._choose(version, self.groups_per_step - len(chosen), len(chosen))
            if not batch:  # wait for a group to finish, be admitted, or be discarded
                self._news.clear()
                since = time.monotonic()
                await self._news.wait()
                waited += time.monotonic() - since
                continue
            chosen += batch
            await self.pipeline.train_groups(batch)  # one call for every group ready now
        metrics = await self.pipeline.finish_step()
        self.ledger.trained(chosen, version)
        took = time.monotonic() - started
        timing = {"step_train_s": took - waited, "step_wait_generation_s": waited, "trainer_idle_share": waited / took}
        return chosen, {**metrics, **timing}

    def logged(self, chosen: list[int]) -> None:
        """The step's statistics are logged: its reports are done with."""
        for gid in chosen:
            del self.reports[gid]

    async def before_sync(self, version: int) -> bool:
        """Wait until the engines may load ``version`` (``forced_lag``); True when admission had no
        credit left at the old version (the whole sync is then exposed)."""
        while not self.ledger.gate.may_sync(self.ledger.oldest_generating(), version):
            self._raise_failure()
            self._reported.clear()
            await self._reported.wait()
        return self.ledger.capacity(self.pipeline.engine_version) == 0

    def opened(self) -> None:
        """The engines hold a new version: the gate opens for it."""
        self._admit()

    async def stop(self, failed: bool) -> None:
        """Groups still generating when the run ends are aborted and counted, never trained."""
        for task in list(self._rollouts):
            task.cancel()
        await asyncio.gather(*self._rollouts, return_exceptions=True)
        self.ledger.abandon_open("run_end")

    async def cut(self) -> AsyncCut:
        """The books now, deep-copied (the run goes on while the checkpoint is written)."""
        ledger = copy.deepcopy(self.ledger)
        open_groups = {gid: g for gid, g in ledger.groups.items() if g.state is GroupState.OPEN}
        regenerate = [(self._generating[gid], gid) for gid, g in sorted(open_groups.items()) if not g.generated]
        reports = {gid: self.reports[gid] for gid, g in open_groups.items() if g.generated}
        return AsyncCut(self._next_group, ledger, reports, regenerate)

    async def resume(self, cut: AsyncCut, version: int) -> None:
        """Continue a checkpointed run: its books, and the groups that were generating at the
        checkpoint, restarted with their ids and prompts and counted."""
        self.ledger, self.reports, self._next_group = copy.deepcopy(cut.ledger), dict(cut.reports), cut.next_group
        self.ledger.regenerated["restart_groups"] += len(cut.regenerate)
        self._start_wave(cut.regenerate)

    def _choose(self, version: int, limit: int, already: int) -> list[int]:
        """Every group the step may take right now, in the order the ledger hands them out."""
        batch: list[int] = []
        while len(batch) < limit:
            gid = self.ledger.next_for_step(version, already + len(batch), self.pipeline.engine_version)
            if gid is None:
                break
            self.ledger.choose(gid)
            batch.append(gid)
        return batch

    def _admit(self) -> None:
        """Start new groups while the gate has credit at the engines' version, all that fit as one
        wave; never past the run's budget (a group no remaining step could train would only be
        generated to be abandoned at the end, on the cores the last steps need)."""
        if self._failure is not None:  # the run is stopping: nothing new starts
            return
        wave = []
        while self.ledger.capacity(self.pipeline.engine_version) > 0 and self._within_budget():
            gid, self._next_group = self._next_group, self._next_group + 1
            self.ledger.admitted(gid, self.pipeline.engine_version)
            wave.append((self.pipeline.next_prompt(), gid))
        self._start_wave(wave)
        self._news.set()

    def _within_budget(self) -> bool:
        if self._budget is None or self._next_group < self._budget:  # no scan of the books needed
            return True
        return self.ledger.accepted + self.ledger.in_flight < self._budget

    def _start_wave(self, wave: list[tuple[PromptItem, int]]) -> None:
        if wave:
            self._generating.update((gid, item) for item, gid in wave)
            task = asyncio.create_task(self._rollout(wave))
            self._rollouts.add(task)
            task.add_done_callback(self._rollouts.discard)

    async def _rollout(self, wave: list[tuple[PromptItem, int]]) -> None:
        try:
            async for report in self.pipeline.rollout_wave(wave):
                self.reported += 1
                self._generating.pop(report.group_id, None)
                if self.ledger.late_report(report.group_id, report.num_samples):
                    continue  # a surplus group, discarded when it was aborted
                reason = report.discard_reason
                if reason is None and not self.ledger.fits(report.version):
                    reason = "redundant"  # finished on newer weights, past that version's quota
                if reason is None:
                    self.ledger.finished(report.group_id, report.version, report.num_samples, report.sample_versions)
                    self.reports[report.group_id] = report  # a discarded group's report is not kept
                else:
                    self.ledger.discarded(report.group_id, reason, report.num_samples)
                if self.failures is not None:
                    self.failures.record(report)  # over budget: raises, the run stops
                await self._abort_surplus()
                self._admit()  # a discard returned its credit; a finished group is news
                self._reported.set()
        except asyncio.CancelledError:
            raise
        except WorkerLost as lost:  # its worker was replaced: the unreported groups start again
            await self._regenerate(lost)
        except BaseException as err:  # surfaced by the training loop, never swallowed
            self._fail(err)

    async def _regenerate(self, lost: WorkerLost) -> None:
        """Once the replacement holds the current weights, restart ``lost``'s groups with their ids
        and prompts (counted ``regenerated_<worker>_lost``; groups aborted before the loss stay
        discarded)."""
        try:
            await lost.recover()
        except BaseException as err:  # surfaced by the training loop, never swallowed
            self._fail(err)
            return
        again = []
        for gid in lost.groups:
            item = self._generating.pop(gid, None)
            if item is not None and self.ledger.groups[gid].state is not GroupState.DISCARDED:
                again.append((item, gid))
        self.ledger.regenerated[f"{lost.worker.replace(' ', '_')}_lost"] += len(again)
        self._start_wave(again)

    def _fail(self, err: BaseException) -> None:
        self._failure = self._failure or err  # the first one is the cause
        self._news.set()
        self._reported.set()

    async def _abort_surplus(self) -> None:
        """Redundant prompts: once the quota is met, stop the groups still generating."""
        surplus = self.ledger.abort_surplus("redundant")
        if surplus:
            await self.pipeline.abort_groups(surplus, "redundant")

    def _raise_failure(self) -> None:
        if isinstance(self._failure, RunStopped):  # its message is the whole story
            raise self._failure
        if self._failure is not None:
            raise RuntimeError("a rollout failed") from self._failure
