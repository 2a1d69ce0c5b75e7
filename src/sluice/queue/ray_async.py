"""``AsyncRayQueue``: the Ray TransferQueue client as coroutines, for async actors.

It reuses ``RayQueue``'s placement, packing and assembly and awaits the same actor calls instead
of blocking on them; metadata-only calls (``clear``, ``snapshot``...) run the blocking client in
a thread. It deliberately holds no state of its own beyond the wrapped ``RayQueue`` (so it
pickles as that does) and does not use the same-node socket path (``direct``), whose calls block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from sluice.api.queue import Batch, Partition, Policy, RowMeta, Shard
from sluice.queue import shm
from sluice.queue.packed import MetaRows
from sluice.queue.ray_backend import RayQueue
from sluice.queue.request import ReadRequest

__all__ = ["AsyncRayQueue"]


class AsyncRayQueue:
    """``RayQueue`` as coroutines (implements ``sluice.api.queue.AsyncQueueClient``); picklable."""

    def __init__(self, queue: RayQueue) -> None:
        self.queue = queue

    async def register_task(self, task: str, input_columns: Sequence[str]) -> None:
        units = self.queue.units
        handle = await units[0].create_controller.remote(task, list(input_columns))
        await asyncio.gather(*(unit.add_controller.remote(task, handle, True) for unit in units))
        self.queue.task_handles[task] = handle

    async def put(
        self,
        indices: Sequence[int],
        columns: Mapping[str, Sequence[Any]],
        meta: Sequence[RowMeta] | None = None,
        *,
        partition: Partition | None = None,
    ) -> None:
        refs, slots = self.queue.write_refs(indices, columns, meta, partition)
        try:
            await asyncio.gather(*refs)
        finally:
            if slots:
                shm.outbox().free(slots)

    async def get(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        policy: str | Policy = "fifo",
        indices: Sequence[int] | None = None,
        min_size: int | None = None,
        timeout: float | None = None,
        partition: int | None = None,
        shard: Shard | None = None,
    ) -> Batch:
        req = ReadRequest.of(task, columns, batch_size, policy, indices, min_size, partition, shard)
        handle: Any = self.queue.task_handles.get(task)
        if handle is None:
            handle = await asyncio.to_thread(self.queue._controller, task)
        rows, done = await handle.select.remote(req, timeout)
        metas = MetaRows(rows)
        positions, refs = self.queue.read_refs(task, metas, req.columns)
        parts = await asyncio.gather(*refs.values())
        return self.queue.assemble(metas, positions, dict(zip(refs, parts, strict=True)), req.columns, done)

    async def clear(self, indices: Sequence[int] | None = None) -> int:
        return await asyncio.to_thread(self.queue.clear, indices)

    async def snapshot(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.queue.snapshot)

    async def restore(self, state: dict[str, Any]) -> None:
        await asyncio.to_thread(self.queue.restore, state)

    async def stats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.queue.stats)

    async def close(self) -> None:
        await asyncio.to_thread(self.queue.close)
