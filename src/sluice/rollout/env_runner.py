"""``EnvRunner``: prompt groups of multi-turn episodes → rows in the TransferQueue (ROLL Flash's
EnvManager, §5.2).

Each admitted group runs ``group_size + group_redundancy`` episodes, each its own loop
(``episode.py``); nothing waits for anything else (docs/agentic.md has each rule and its counter):

- **environment-level async** (``mode: async``): an episode waiting on its environment holds no
  engine slot; ``mode: barrier`` moves a wave's episodes in lockstep, the baseline;
- **rows at once**: a finished episode's sample is written the moment it ends, group-committed
  with the others ending meanwhile (``GroupCommitWriter``); a group reports as soon as its first
  ``group_size`` episodes finished;
- **redundant environments**: the episodes still running when their group completes are aborted
  and counted (``episodes_aborted_straggler``); the controller aborts surplus groups
  (``abort_groups``);
- **failures**: an env that raises or exceeds its timeout fails its episode; a group that can no
  longer reach ``group_size`` is discarded (``env_failure``, its rows cleared, its credit
  returned), its report naming the environment and the last env error (``failed_by``, ``error``).

It decides no admission, quota or version (the controller does) and knows no env internals.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from sluice.api import AsyncQueueClient, GroupReport, PromptItem, Sample
from sluice.queue.samples import samples_to_rows
from sluice.rollout.episode import EpisodeFailed, EpisodeRunner, TurnBarrier

if TYPE_CHECKING:
    from sluice.rollout.agent_runner import AgentEpisodeRunner
from sluice.rollout.group_tasks import GroupTasks
from sluice.rollout.groups import GroupCommitWriter
from sluice.telemetry.trace import SpanRecorder

ENV_FAILURE = "env_failure"
ENV_FAULTS = ("env_error", "env_timeout", "agent_error", "agent_timeout", "template_mismatch")
"""Episode failures that are the environment's or the agent's (the run's failure budget counts
their groups)."""


class EnvRunner:
    """Runs groups of episodes and stores their samples (see the module docstring). Exposes the
    ``GroupRunner`` verbs, so the rollout worker and the controller drive either alike."""

    def __init__(
        self,
        episodes: EpisodeRunner | AgentEpisodeRunner,
        queue: AsyncQueueClient,
        *,
        group_size: int,
        group_redundancy: int = 0,
        mode: str = "async",
        tracer: SpanRecorder | None = None,
        name: str = "env",
        role: str = "environment",
    ) -> None:
        if mode not in ("async", "barrier"):
            raise ValueError(f"unknown env rollout mode {mode!r}; expected 'async' or 'barrier'")
        self.episodes = episodes
        self.queue = queue
        self.writer = GroupCommitWriter(queue)
        self.group_size = group_size
        self.group_redundancy = group_redundancy
        self.mode = mode
        self.name = name
        """The environment's name in a failed group's report (``agentic.env``), or the agent's."""
        self.role = role
        """``environment``, or ``agent`` (``agentic.agent``): what a failed group's report blames."""
        self.tracer = tracer or SpanRecorder("rollout", enabled=False)
        self.counts: Counter[str] = Counter()
        self._groups = GroupTasks()

    async def run_groups(self, groups: Sequence[tuple[PromptItem, int]]) -> AsyncIterator[GroupReport]:
        """Start a wave of groups together; report each as it completes (completion order)."""
        per_group = self.group_size + self.group_redundancy
        barrier = TurnBarrier(per_group * len(groups)) if self.mode == "barrier" else None
        work = {gid: self.run_group(item, gid, barrier) for item, gid in groups}

        def skipped(group_id: int) -> None:  # aborted before it started: its episodes never join
            for _ in range(per_group if barrier is not None else 0):
                barrier.leave()  # type: ignore[union-attr]

        try:
            async for report in self._groups.stream(work, self.group_size, skipped):
                yield report
        finally:
            if barrier is not None:
                self.counts["barrier_waits"] += barrier.waits

    def abort_groups(self, group_ids: Sequence[int], reason: str) -> None:
        """Stop these groups (surplus env groups); each reports ``reason``."""
        self._groups.abort(group_ids, reason)

    async def run_group(self, item: PromptItem, group_id: int, barrier: TurnBarrier | None = None) -> GroupReport:
        """The group's episodes until ``group_size`` finished (or too many failed)."""
        total = self.group_size + self.group_redundancy
        tasks = [asyncio.ensure_future(self.episodes.run(item, group_id, k, barrier)) for k in range(total)]
        if barrier is not None:  # a done callback runs even for an episode cancelled before it started
            for task in tasks:
                task.add_done_callback(lambda _: barrier.leave())
        self.counts["episodes_started"] += total
        kept: list[Sample] = []
        writes: list[asyncio.Future[None]] = []  # one per kept sample: its row's write, under way
        failed = 0
        env_error = ""
        try:
            with self.tracer.span("episodes", lane=f"group{group_id % 8}", group=group_id):
                for next_done in asyncio.as_completed(tasks):
                    try:
                        sample = await next_done
                    except EpisodeFailed as failure:
                        self.counts[f"episodes_{failure.reason}"] += 1
                        failed += 1
                        if failure.reason in ENV_FAULTS:
                            env_error = str(failure)
                        if total - failed < self.group_size:
                            break
                        continue
                    writes.append(asyncio.ensure_future(self._put(sample, len(kept))))
                    kept.append(sample)
                    if len(kept) == self.group_size:
                        break
        except asyncio.CancelledError:
            self.counts["episodes_group_aborted"] += len(kept)  # finished, but their group was stopped
            await self._stop(tasks, len(kept), "episodes_cancelled")
            if writes:  # the kept rows land before they are cleared
                await asyncio.wait(writes)
            await self._clear(group_id, len(kept))
            raise
        await self._stop(tasks, len(kept), "episodes_aborted_straggler")
        await asyncio.gather(*writes)  # the group's rows are stored before it reports
        if len(kept) < self.group_size:
            self.counts["episodes_group_failed"] += len(kept)
            await self._clear(group_id, len(kept))
            report = self._report(group_id, kept, ENV_FAILURE)
            if env_error:
                report = replace(report, failed_by=f"{self.role} {self.name!r}", error=env_error)
            return report
        self.counts["episodes_kept"] += len(kept)
        return self._report(group_id, kept, None)

    def stats(self) -> dict[str, float]:
        """Episode fates (each started episode has exactly one): ``kept``, ``finished_surplus``
        (finished with the group's last kept one), ``aborted_straggler``, ``env_timeout`` /
        ``env_error`` / ``engine_abort`` (failed), ``group_failed`` / ``group_aborted`` (finished,
        but their group was discarded or stopped), ``cancelled`` (stopped with their group); and
        ``queue_puts`` / ``queue_writes``: rows handed to the writer, queue calls that carried them."""
        writes = {"queue_puts": self.writer.puts, "queue_writes": self.writer.writes}
        return {f"env_{k}": float(v) for k, v in (self.counts | self.episodes.stats() | writes).items()}

    async def _stop(self, tasks: list[asyncio.Task[Sample]], kept: int, counter: str) -> None:
        """Cancel the episodes still running (their requests are aborted on the engines); count
        them, and those that finished in the same instant as the last kept one (surplus)."""
        running = [t for t in tasks if not t.done()]
        for task in running:
            task.cancel()
        self.counts[counter] += len(running)
        finished = sum(1 for t in tasks if t.done() and not t.cancelled() and t.exception() is None)
        self.counts["episodes_finished_surplus"] += max(0, finished - kept)
        await asyncio.gather(*running, return_exceptions=True)

    async def _put(self, sample: Sample, position: int) -> None:
        """Write one episode's row at once: row ``group_id · group_size + position``."""
        _, columns, meta = samples_to_rows([sample], self.group_size)
        row = sample.group_id * self.group_size + position
        with self.tracer.span("queue_put", lane="queue", group=sample.group_id):
            await self.writer.put([row], columns, [replace(meta[0], index=row)])

    async def _clear(self, group_id: int, written: int) -> None:
        if written:
            base = group_id * self.group_size
            await self.queue.clear(list(range(base, base + written)))

    def _report(self, group_id: int, samples: list[Sample], reason: str | None) -> GroupReport:
        return GroupReport(
            group_id=group_id,
            version=min((s.version for s in samples), default=-1),
            num_samples=self.group_size,
            response_tokens=sum(len(s.response_ids) for s in samples),
            rewards=tuple(s.reward for s in samples),
            discard_reason=reason,
            finished_at=time.time(),
            response_lengths=tuple(len(s.response_ids) for s in samples),
            truncated=sum(s.meta.get("finish_reason") == "length" for s in samples),
        )
