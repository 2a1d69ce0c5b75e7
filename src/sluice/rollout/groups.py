"""Group scheduling inside a rollout worker: prompt groups → scored, filtered, stored groups.

``GroupRunner`` takes a wave of admitted groups and reports each as it ends, in one of two
schedules (ROLL Flash §5.1.1):

- ``queue`` (default): every group is an independent task; each sample is scored as soon as it
  finishes (overlapping its siblings' generation), the whole group by the reward model
  (``reward.model``, batched with the groups finishing beside it) once its last sample is; each
  group is filtered and written to the TransferQueue the moment it is scored, so one long group
  never holds the others;
- ``batch``: the classic barrier: the whole wave generates, then every sample is scored, then
  groups are filtered and written. A filtered group's credit brings a new wave: the rounds
  repeat until the step has its groups.

Writes are group-committed (``GroupCommitWriter``): a group finishing while an earlier write is
still in flight joins the next write, so a burst of finished groups costs one queue call, not one
each, and a lone group is written at once.

``abort_groups`` stops groups that became surplus (redundant prompts once the step's quota is
met): their requests are aborted on the engines and each is reported as discarded with the
given reason. The runner decides no admission and no quota; the controller does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any, Literal

from sluice.api import (
    AsyncQueueClient,
    GroupReport,
    InferenceEngine,
    Partition,
    PromptItem,
    RewardFn,
    RowMeta,
    Sample,
)
from sluice.queue.samples import samples_to_rows
from sluice.rewards.combine import ModelReward
from sluice.rollout.filters import GroupFilter, reward_failure, reward_failure_cause
from sluice.rollout.group_tasks import GroupTasks
from sluice.rollout.single_turn import SingleTurnWorkflow
from sluice.telemetry.trace import SpanRecorder

Scheduling = Literal["queue", "batch"]
_Rows = tuple[Sequence[int], Mapping[str, Sequence[Any]], Sequence[RowMeta], Partition | None]


class GroupCommitWriter:
    """Queue writes of whole groups, group-committed: ``put`` returns once the rows are stored;
    rows handed in while a write is in flight go out together in the next one (in arrival order).
    A failed write fails every ``put`` it carried."""

    def __init__(self, queue: AsyncQueueClient) -> None:
        self.queue = queue
        self._pending: list[tuple[_Rows, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None
        self.writes = 0
        """Queue calls made (``puts`` / ``writes`` is the batching achieved)."""
        self.puts = 0

    async def put(
        self,
        indices: Sequence[int],
        columns: Mapping[str, Sequence[Any]],
        meta: Sequence[RowMeta],
        partition: Partition | None = None,
    ) -> None:
        """Store one group's rows (into ``partition``, if given: a multi-controller run's step)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(((indices, columns, meta, partition), done))
        self.puts += 1
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write_pending())
        await done

    async def _write_pending(self) -> None:
        while self._pending:
            first = self._pending[0][0][3]  # one queue call per partition: the rows of one step
            cut = next((k for k, (rows, _) in enumerate(self._pending) if rows[3] != first), len(self._pending))
            batch, self._pending = self._pending[:cut], self._pending[cut:]
            indices = [i for (rows, _) in batch for i in rows[0]]
            columns = {name: [v for (rows, _) in batch for v in rows[1][name]] for name in batch[0][0][1]}
            meta = [m for (rows, _) in batch for m in rows[2]]
            self.writes += 1
            try:
                await self.queue.put(indices, columns, meta, partition=first)
            except asyncio.CancelledError:
                for _, done in batch:
                    done.cancel()
                raise
            except Exception as err:  # each put it carried raises it
                for _, done in batch:
                    if not done.done():
                        done.set_exception(err)
                continue
            for _, done in batch:
                if not done.done():  # a cancelled put (aborted group) still had its rows stored
                    done.set_result(None)


class GroupRunner:
    """Generates, scores, filters and stores prompt groups through one engine (or ``LLMProxy``)."""

    def __init__(
        self,
        engine: InferenceEngine,
        workflow: SingleTurnWorkflow,
        queue: AsyncQueueClient,
        reward: RewardFn,
        *,
        group_filter: GroupFilter | None = None,
        scheduling: Scheduling = "queue",
        tracer: SpanRecorder | None = None,
        model_reward: ModelReward | None = None,
    ) -> None:
        if scheduling not in ("queue", "batch"):
            raise ValueError(f"unknown scheduling {scheduling!r}; expected 'queue' or 'batch'")
        self.engine = engine
        self.workflow = workflow
        self.queue = queue
        self.writer = GroupCommitWriter(queue)
        self.reward = reward
        self.group_filter = group_filter
        self.scheduling = scheduling
        self.tracer = tracer or SpanRecorder("rollout", enabled=False)
        self.model_reward = model_reward
        """The reward model (``reward.model``): scores each finished group before its filters."""
        self._groups = GroupTasks()
        self._partitions: dict[int, Partition] = {}
        """The queue partition of each group of a multi-controller run still to be stored."""

    async def run_groups(
        self, groups: Sequence[tuple[PromptItem, int]], partitions: Mapping[int, Partition] | None = None
    ) -> AsyncIterator[GroupReport]:
        """Start a wave of groups together, then report each as it ends (completion order).

        Submitting a whole admission wave before the engine takes its next step makes the
        engine's batches independent of message timing, so a wave reproduces the sync loop's
        batches exactly. ``partitions``: the queue partition (step) each group's rows join.
        """
        self._partitions.update(partitions or {})
        if self.scheduling == "batch":
            work = self._batch(groups)
        else:
            work = {gid: self.run_group(item, gid) for item, gid in groups}
        async for report in self._groups.stream(work, self.workflow.group_size):
            yield report

    def abort_groups(self, group_ids: Sequence[int], reason: str) -> None:
        """Stop these groups; each reports ``reason``. A group whose wave has not arrived yet is
        reported at once when it does; one that already finished stays reported as it was."""
        self._groups.abort(group_ids, reason)

    async def run_group(self, item: PromptItem, group_id: int) -> GroupReport:
        with self.tracer.span("generate", lane=f"group{group_id % 8}", group=group_id):
            samples = await self.workflow.run(item, group_id, self.engine, self.reward)
        return await self._store(group_id, samples, item)

    def _batch(self, groups: Sequence[tuple[PromptItem, int]]) -> dict[int, Awaitable[GroupReport]]:
        """One awaitable per group that scores only after the whole wave has generated."""
        items = {gid: item for item, gid in groups}
        gens = {gid: asyncio.ensure_future(self.workflow.generate(item, gid, self.engine)) for item, gid in groups}
        barrier = asyncio.ensure_future(asyncio.wait(list(gens.values())))

        async def report(gid: int) -> GroupReport:
            try:
                await asyncio.shield(barrier)
            except asyncio.CancelledError:  # aborted (or the wave was dropped): stop its requests
                gens[gid].cancel()
                raise
            with self.tracer.span("reward", lane=f"group{gid % 8}", group=gid):
                samples = await self.workflow.score(items[gid], gid, gens[gid].result(), self.reward)
            return await self._store(gid, samples, items[gid])

        return {gid: report(gid) for gid in gens}

    async def _store(self, group_id: int, samples: list[Sample], item: PromptItem) -> GroupReport:
        if self.model_reward is not None and reward_failure(samples) is None:
            with self.tracer.span("reward_model", lane="reward_model", group=group_id):
                samples = await self.model_reward.apply(item.prompt, samples, self._decode)
        reason = reward_failure(samples) or (self.group_filter(samples) if self.group_filter else None)
        failed_by, error = reward_failure_cause(samples) or (None, "")
        partition = self._partitions.pop(group_id, None)
        if reason is None:
            indices, columns, meta = samples_to_rows(samples, self.workflow.group_size)
            with self.tracer.span("queue_put", lane="queue", group=group_id):
                await self.writer.put(indices, columns, meta, partition)
        return GroupReport(
            group_id=group_id,
            version=min(s.version for s in samples),
            num_samples=len(samples),
            response_tokens=sum(len(s.response_ids) for s in samples),
            rewards=tuple(s.reward for s in samples),
            discard_reason=reason,
            finished_at=time.time(),
            sample_versions=tuple(s.version for s in samples),
            failed_by=failed_by,
            error=error,
            response_lengths=tuple(len(s.response_ids) for s in samples),
            truncated=sum(s.meta.get("finish_reason") == "length" for s in samples),
            data_source=str(item.fields.get("data_source", "")),
            rm_scores=tuple(s.meta["rm_score"] for s in samples if "rm_score" in s.meta),
        )

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.workflow.tokenizer.decode(list(ids), skip_special_tokens=True))
