"""The training loop of both modes: admission, rollout, training and weight sync over one pipeline.

It reads as the algorithm; the ledger keeps the books, the pipeline does the work:

    admit groups while the gate has credit (plus redundant ones) → each rollout generates, scores
      and writes its group; once the quota is met, surplus groups still generating are aborted
    for each step v: take groups (oldest ready first, waiting for old ones still generating when
      the staleness deadlines need them) and stream them
      into the trainer → optimizer step (v → v+1) → weight sync to the engines (in the
      background; admission opens for v+1 once the engines hold it)

``run.mode: async`` runs those concurrently under the staleness bound η, samples streaming
through the TransferQueue. ``run.mode: sync`` is the same loop with ``barrier=True`` at η = 0:
a step trains only once none of its groups is generating, and the engines load v + 1 before the
step is reported. The driver only moves group ids, versions and counters; sample data goes
rollout → queue → trainer directly. Both schedules compute the same steps (the golden-loss test).
Every reported group also goes to the run's ``FailureBudget`` (``failures.py``): a reward or
environment over budget stops admission and ends the run with its one-line ``RunStopped`` error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

from sluice.api import GroupReport, PromptItem
from sluice.runtime.supervision import WorkerLost
from sluice.schedule.failures import FailureBudget, RunStopped
from sluice.schedule.ledger import GroupLedger, GroupState


class Pipeline(Protocol):
    """What the loop drives (``runtime/pipelines.py`` builds local and Ray ones)."""

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


StepCallback = Callable[[int, list[int], dict[str, float]], Awaitable[bool]]


class Controller:
    """Runs ``steps`` training steps of ``groups_per_step`` groups over a ``Pipeline``."""

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
        self.failures = failures
        """Judges every reported group; ``None``: failures never stop the run."""
        self.barrier = barrier
        """The ``sync`` schedule: a step trains only once no group is generating, and the engines
        load the new version before the step is reported (no overlap of any kind)."""
        self.ledger = ledger
        self.groups_per_step = groups_per_step
        self.version = pipeline.engine_version
        self.reports: dict[int, GroupReport] = {}
        """Reports of the finished groups not yet trained, and of the step's groups until its
        ``after_step`` returns; then they are dropped, so a long run holds a bounded number."""
        self._report_count = 0
        self._next_group = 0
        self._generating: dict[int, PromptItem] = {}
        """Prompts of groups admitted and not yet reported (a checkpoint restarts them)."""
        self._news = asyncio.Event()
        self._reported = asyncio.Event()
        """Set on every group report and failure; the weight sync's own wake-up (``forced_lag``)."""
        self._rollouts: set[asyncio.Task[None]] = set()
        self._sync: asyncio.Task[None] | None = None
        self.sync_metrics: dict[str, float] = {}
        """Timings of the most recent completed weight sync."""
        self._failure: BaseException | None = None
        self._budget: int | None = None
        """Groups the run can ever train (its steps' quota plus the redundant ones); ``None``: no cap."""

    async def run(self, steps: int, after_step: StepCallback) -> None:
        self._budget = steps * self.groups_per_step + self.ledger.redundant_groups
        self._admit()
        try:
            while self.version < steps:
                chosen = await self._train_step()  # stream B groups into the trainer
                metrics = await self.pipeline.finish_step()  # optimizer step: v -> v + 1
                self.ledger.trained(chosen, self.version)
                self.version += 1
                await self._await_sync()  # one weight sync in flight at a time
                self._sync = asyncio.create_task(self._sync_weights(self.version))
                if self.barrier:  # sync: the engines hold v + 1 before anything else happens
                    await self._await_sync()
                keep_going = await after_step(self.version, chosen, metrics)
                for gid in chosen:  # the step's statistics are logged: its reports are done with
                    del self.reports[gid]
                if not keep_going:
                    break
            await self._await_sync()
        finally:
            await self._stop_rollouts()

    async def _train_step(self) -> list[int]:
        await self.pipeline.begin_step()
        chosen: list[int] = []
        while len(chosen) < self.groups_per_step:
            self._raise_failure()
            generating = self.barrier and self.ledger.in_flight > 0
            batch = [] if generating else self._choose(self.groups_per_step - len(chosen), already=len(chosen))
            if not batch:  # wait for a group to finish, be admitted, or be discarded
                self._news.clear()
                await self._news.wait()
                continue
            chosen += batch
            await self.pipeline.train_groups(batch)  # one call for every group ready now
        return chosen

    def _choose(self, limit: int, already: int) -> list[int]:
        """Every group the step may take right now, in the order the ledger hands them out."""
        batch: list[int] = []
        while len(batch) < limit:
            gid = self.ledger.next_for_step(self.version, already + len(batch), self.pipeline.engine_version)
            if gid is None:
                break
            self.ledger.choose(gid)
            batch.append(gid)
        return batch

    def _admit(self) -> None:
        """Start new groups while ``accepted + in_flight < (v + η + 1) · B`` (v = engines' version),
        all that fit as one wave; never past the run's budget (a group no remaining step could
        train would only be generated to be abandoned at the end, on the cores the last steps need)."""
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

    def progress(self) -> tuple[int, int]:
        """(policy version, groups reported): changes whenever the loop moves."""
        return self.version, self._report_count

    @property
    def next_group(self) -> int:
        return self._next_group

    def generating_prompts(self) -> dict[int, PromptItem]:
        """Prompts of the groups admitted and not yet reported, by group id."""
        return dict(self._generating)

    def resume(
        self,
        ledger: GroupLedger,
        reports: dict[int, GroupReport],
        next_group: int,
        regenerate: list[tuple[PromptItem, int]],
    ) -> None:
        """Continue a checkpointed run (``controller/resume.py``): its books, and the groups that
        were generating at the checkpoint, restarted with their ids and prompts and counted."""
        self.ledger, self.reports, self._next_group = ledger, dict(reports), next_group
        self.ledger.regenerated["restart_groups"] += len(regenerate)
        self._start_wave(regenerate)

    async def _rollout(self, wave: list[tuple[PromptItem, int]]) -> None:
        try:
            async for report in self.pipeline.rollout_wave(wave):
                self._report_count += 1
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

    async def _sync_weights(self, version: int) -> None:
        """Engines load ``version``. Exposed time: the worker's fetch + load (generation stalls
        for it), or the whole sync when admission had no credit left at the old version."""
        while not self.ledger.gate.may_sync(self.ledger.oldest_generating(), version):  # forced_lag
            self._raise_failure()
            self._reported.clear()
            await self._reported.wait()
        starved = self.ledger.capacity(self.pipeline.engine_version) == 0
        started = time.monotonic()
        metrics = await self.pipeline.sync_weights(version)
        took = time.monotonic() - started
        stalled = metrics.get("weight_fetch_s", 0.0) + metrics.get("weight_load_s", 0.0)
        self.sync_metrics = {**metrics, "weight_sync_s": took, "exposed_weight_sync_s": took if starved else stalled}
        self._admit()  # the engines hold `version`: the gate opens for it

    async def _await_sync(self) -> None:
        if self._sync is not None:
            await self._sync
            self._sync = None

    async def _stop_rollouts(self) -> None:
        """Groups still generating when the run ends are aborted and counted, never trained."""
        for task in list(self._rollouts):
            task.cancel()
        await asyncio.gather(*self._rollouts, return_exceptions=True)
        self.ledger.abandon_open("run_end")

    def _raise_failure(self) -> None:
        if isinstance(self._failure, RunStopped):  # its message is the whole story
            raise self._failure
        if self._failure is not None:
            raise RuntimeError("a rollout failed") from self._failure
