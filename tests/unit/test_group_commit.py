"""GroupCommitWriter: groups finishing while a write is in flight share the next queue call; rows
arrive in order and complete; a failed write fails every put it carried."""

from __future__ import annotations

import asyncio

import pytest

from sluice.api import Partition, RowMeta
from sluice.rollout.groups import GroupCommitWriter


class SlowQueue:
    """Records each put; a put completes only when the test releases it."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[int]] = []
        self.partitions: list[Partition | None] = []
        self.rows: dict[int, int] = {}
        self.release = asyncio.Event()
        self.fail = fail

    async def put(self, indices, columns, meta=None, *, partition=None) -> None:
        self.calls.append(list(indices))
        self.partitions.append(partition)
        await self.release.wait()
        self.release.clear()
        if self.fail:
            raise RuntimeError("storage unit down")
        self.rows.update(zip(indices, columns["x"], strict=True))
        assert [m.index for m in meta] == list(indices)


def _group(gid: int) -> tuple[list[int], dict[str, list[int]], list[RowMeta]]:
    rows = [2 * gid, 2 * gid + 1]
    meta = [RowMeta(index=i, group_id=gid, version=0, num_tokens=1, group_size=2) for i in rows]
    return rows, {"x": [10 * i for i in rows]}, meta


def test_groups_finishing_during_a_write_share_the_next_one():
    async def main():
        queue = SlowQueue()
        writer = GroupCommitWriter(queue)
        first = asyncio.ensure_future(writer.put(*_group(0)))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(writer.put(*_group(g))) for g in (1, 2, 3)]
        await asyncio.sleep(0)
        assert queue.calls == [[0, 1]] and not first.done()
        queue.release.set()
        await first
        await asyncio.sleep(0)
        assert queue.calls == [[0, 1], [2, 3, 4, 5, 6, 7]]  # one call for the three that waited
        assert not any(t.done() for t in rest)
        queue.release.set()
        await asyncio.gather(*rest)
        assert queue.rows == {i: 10 * i for i in range(8)}
        assert (writer.puts, writer.writes) == (4, 2)

    asyncio.run(main())


def test_a_failed_write_fails_every_put_it_carried():
    async def main():
        queue = SlowQueue(fail=True)
        writer = GroupCommitWriter(queue)
        puts = [asyncio.ensure_future(writer.put(*_group(g))) for g in (0, 1)]
        await asyncio.sleep(0)
        queue.release.set()
        results = await asyncio.gather(*puts, return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results)
        assert queue.calls == [[0, 1, 2, 3]]

    asyncio.run(main())


def test_a_cancelled_put_does_not_break_the_others():
    async def main():
        queue = SlowQueue()
        writer = GroupCommitWriter(queue)
        a = asyncio.ensure_future(writer.put(*_group(0)))
        b = asyncio.ensure_future(writer.put(*_group(1)))
        await asyncio.sleep(0)
        a.cancel()
        queue.release.set()
        await b
        with pytest.raises(asyncio.CancelledError):
            await a
        assert queue.rows == {i: 10 * i for i in range(4)}  # its rows were stored all the same

    asyncio.run(main())


def test_groups_of_different_steps_go_out_in_one_call_per_partition():
    """A multi-controller run's groups carry their step: rows of two partitions never share a
    queue call (the call declares its partition's expected rows)."""

    async def main():
        queue = SlowQueue()
        writer = GroupCommitWriter(queue)
        first = asyncio.ensure_future(writer.put(*_group(0), Partition(0, 4)))
        await asyncio.sleep(0)
        steps = [Partition(0, 4), Partition(1, 4), Partition(1, 4)]
        rest = [asyncio.ensure_future(writer.put(*_group(g), p)) for g, p in zip((1, 2, 3), steps, strict=True)]
        await asyncio.sleep(0)
        for _ in range(3):
            queue.release.set()
            await asyncio.sleep(0.01)
        await asyncio.gather(first, *rest)
        assert queue.calls == [[0, 1], [2, 3], [4, 5, 6, 7]]
        assert queue.partitions == [Partition(0, 4), Partition(0, 4), Partition(1, 4)]

    asyncio.run(main())
