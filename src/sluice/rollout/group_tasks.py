"""``GroupTasks``: the running prompt groups of a rollout runner, each abortable by id.

A runner (``GroupRunner`` for single-turn groups, ``EnvRunner`` for groups of episodes) hands it
one awaitable per group of a wave; it reports each group as it ends, in completion order, and
``abort`` stops groups that became surplus: each then reports as discarded with the given reason
(``size`` samples, no data), even one whose wave has not started yet. It decides nothing about
which groups to stop; the controller does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

from sluice.api import GroupReport


class GroupTasks:
    """Abortable group tasks (see the module docstring)."""

    def __init__(self) -> None:
        self._tasks: dict[int, asyncio.Task[GroupReport]] = {}
        self._aborting: dict[int, str] = {}

    async def stream(
        self,
        work: Mapping[int, Awaitable[GroupReport]],
        size: int,
        skipped: Callable[[int], None] | None = None,
    ) -> AsyncIterator[GroupReport]:
        """Run every group's ``work`` at once and yield its report as each ends. ``skipped(gid)``
        is called for a group aborted before its work started (its work never runs)."""
        tasks = {gid: asyncio.ensure_future(self._abortable(gid, coro, size, skipped)) for gid, coro in work.items()}
        self._tasks.update(tasks)
        try:
            for done in asyncio.as_completed(list(tasks.values())):
                yield await done
        finally:
            for gid, task in tasks.items():
                task.cancel()
                self._tasks.pop(gid, None)

    def abort(self, group_ids: Sequence[int], reason: str) -> None:
        """Stop these groups; each reports ``reason``. A group whose wave has not arrived yet is
        reported at once when it does; one that already finished stays reported as it was."""
        for gid in group_ids:
            task = self._tasks.get(gid)
            if task is None or not task.done():
                self._aborting[gid] = reason
            if task is not None:
                task.cancel()

    async def _abortable(
        self, group_id: int, work: Awaitable[GroupReport], size: int, skipped: Callable[[int], None] | None
    ) -> GroupReport:
        try:
            if group_id in self._aborting:  # stopped before its wave arrived
                if asyncio.iscoroutine(work):
                    work.close()
                if skipped is not None:
                    skipped(group_id)
                raise asyncio.CancelledError
            return await work
        except asyncio.CancelledError:
            reason = self._aborting.pop(group_id, None)
            if reason is None:
                raise
            return GroupReport(group_id, -1, size, 0, (), discard_reason=reason, finished_at=time.time())
