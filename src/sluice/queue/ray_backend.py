"""The TransferQueue on Ray: storage units and per-task controllers as async actors.

``RayQueue.create(num_storage_units)`` starts the storage-unit actors (``num_cpus=0``); each
``register_task`` has unit 0 start that task's controller actor (so the queue's actors share
its owner's lifetime) and registers it with every unit, which shows it the rows it already holds.
Clients talk to controllers for metadata and to storage units for data, directly:

- put: the client splits rows by ``index % num_units`` and writes each unit in parallel; a unit
  stores the values, then notifies every registered controller of the (rows, columns) it made
  ready and only then acknowledges, so a put is visible to every task when it returns.
- get: the controller selects and marks rows consumed, waiting (on futures woken by those
  notifications; async actors, so a waiting get never blocks other calls) until enough rows are
  ready or the timeout passes; the client then reads the chosen rows from the units in parallel.

``RayQueue`` (blocking) and ``AsyncRayQueue`` (coroutines, for async actors) are picklable: hand
them to Ray tasks and actors. The semantics are ``LocalQueue``'s. It deliberately does not make
``snapshot``/``clear`` atomic across actors (take them while the pipeline is paused, e.g. at a
step boundary), survive the loss of a unit actor, or move data through the driver.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from sluice.api.queue import Batch, Policy, RowMeta
from sluice.queue.client import check_put, deadline_of, needed, remaining, resolve
from sluice.queue.controller import TaskController
from sluice.queue.storage import (
    InMemoryStorageUnit,
    group_by_columns,
    merge_snapshots,
    partition,
    scatter_back,
    select_rows,
    split_snapshot,
)

logger = logging.getLogger(__name__)


class ControllerActor:
    """One task's controller as an async actor: selection with server-side long-poll."""

    def __init__(self, task: str, input_columns: Sequence[str]) -> None:
        self._ctl = TaskController(task, input_columns)
        self._closed = False

    async def input_columns(self) -> tuple[str, ...]:
        return self._ctl.input_columns

    async def notify_ready(self, metas: list[RowMeta], columns: list[str]) -> None:
        self._ctl.notify_ready(metas, columns)

    async def select(
        self,
        columns: list[str],
        batch_size: int,
        policy: str | Policy,
        indices: list[int] | None,
        min_size: int | None,
        timeout: float | None,
    ) -> list[RowMeta]:
        deadline = deadline_of(timeout)
        loop = asyncio.get_running_loop()
        while True:
            need = needed(batch_size, min_size, self._closed, deadline)
            metas = self._ctl.select(columns, batch_size, policy, indices, need)
            if metas is not None:
                return metas
            fut: asyncio.Future[None] = loop.create_future()
            waiter = functools.partial(resolve, fut)
            self._ctl.add_waiter(waiter)
            try:
                await asyncio.wait([fut], timeout=remaining(deadline))
            finally:
                self._ctl.remove_waiter(waiter)

    async def consumed(self) -> set[int]:
        return self._ctl.consumed

    async def forget(self, indices: list[int]) -> None:
        self._ctl.forget(indices)

    async def snapshot(self) -> dict[str, Any]:
        return self._ctl.snapshot()

    async def restore(self, state: dict[str, Any]) -> None:
        self._ctl.restore(state)

    async def stats(self) -> dict[str, int]:
        return self._ctl.stats()

    async def close(self) -> None:
        self._closed = True
        self._ctl.wake()


class StorageActor:
    """One storage unit as an async actor; broadcasts write notifications to the controllers."""

    def __init__(self) -> None:
        self._unit = InMemoryStorageUnit()
        self._controllers: dict[str, Any] = {}  # task -> controller handle, notified on writes
        self._owned: dict[str, Any] = {}  # controllers this unit started (unit 0 only)

    async def create_controller(self, task: str, input_columns: list[str]) -> Any:
        """Start the task's controller once; later calls must name the same columns."""
        handle = self._owned.get(task)
        if handle is None:
            handle = self._owned[task] = _Controller.remote(task, input_columns)
            return handle
        existing = await handle.input_columns.remote()
        if existing != tuple(dict.fromkeys(input_columns)):
            raise ValueError(f"task {task!r} already registered with {existing}")
        return handle

    async def controllers(self) -> dict[str, Any]:
        return dict(self._owned)

    async def add_controller(self, task: str, handle: Any, show_rows: bool) -> None:
        """Notify ``handle`` of every later write (and, with ``show_rows``, of the rows held now)."""
        if task in self._controllers:
            return
        self._controllers[task] = handle
        if show_rows:
            groups = group_by_columns(self._unit.catalog())
            await asyncio.gather(*(handle.notify_ready.remote(metas, list(names)) for names, metas in groups.items()))

    async def write(self, indices: list[int], columns: dict[str, Sequence[Any]], meta: list[RowMeta] | None) -> None:
        metas = self._unit.write(indices, columns, meta)
        names = list(columns)
        await asyncio.gather(*(h.notify_ready.remote(metas, names) for h in self._controllers.values()))

    async def read(self, indices: list[int], columns: list[str]) -> dict[str, Sequence[Any]]:
        return self._unit.read(indices, columns)

    async def drop(self, indices: list[int]) -> int:
        return self._unit.drop(indices)

    async def snapshot(self) -> dict[str, Any]:
        return self._unit.snapshot()

    async def restore(self, state: dict[str, Any]) -> None:
        self._unit.restore(state)

    async def stats(self) -> dict[str, Any]:
        return self._unit.stats()


_Controller = ray.remote(num_cpus=0)(ControllerActor)
_Storage = ray.remote(num_cpus=0)(StorageActor)


class RayQueue:
    """Blocking TransferQueue client over Ray actors (implements ``sluice.api.queue.QueueClient``).

    Picklable. Do not call it from an async actor's event loop; use ``as_async()`` there.
    """

    def __init__(self, units: Sequence[Any]) -> None:
        self.units = list(units)
        self.task_handles: dict[str, Any] = {}  # cache: task -> controller handle

    @classmethod
    def create(cls, num_storage_units: int = 1, tasks: Mapping[str, Sequence[str]] | None = None) -> RayQueue:
        """Start the storage-unit actors on the connected Ray cluster (and ``tasks``' controllers)."""
        if num_storage_units < 1:
            raise ValueError("num_storage_units must be >= 1")
        if not ray.is_initialized():
            raise RuntimeError("ray.init() first")
        queue = cls([_Storage.remote() for _ in range(num_storage_units)])
        for task, input_columns in (tasks or {}).items():
            queue.register_task(task, input_columns)
        return queue

    def as_async(self) -> AsyncRayQueue:
        return AsyncRayQueue(self)

    def register_task(self, task: str, input_columns: Sequence[str]) -> None:
        handle = ray.get(self.units[0].create_controller.remote(task, list(input_columns)))
        ray.get([unit.add_controller.remote(task, handle, True) for unit in self.units])
        self.task_handles[task] = handle

    def put(
        self, indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[RowMeta] | None = None
    ) -> None:
        ray.get(self.write_refs(indices, columns, meta))

    def get(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        policy: str | Policy = "fifo",
        indices: Sequence[int] | None = None,
        min_size: int | None = None,
        timeout: float | None = None,
    ) -> Batch:
        wanted = None if indices is None else list(indices)
        handle = self._controller(task)
        metas = ray.get(handle.select.remote(list(columns), batch_size, policy, wanted, min_size, timeout))
        positions, refs = self.read_refs(metas, columns)
        return assemble(metas, positions, dict(zip(refs, ray.get(list(refs.values())), strict=True)), columns)

    def clear(self, indices: Sequence[int] | None = None) -> int:
        handles = list(ray.get(self.units[0].controllers.remote()).values())
        if indices is None:
            indices = common_rows(ray.get([h.consumed.remote() for h in handles]))
        dropped = ray.get(self.drop_refs(indices))
        ray.get([h.forget.remote(list(indices)) for h in handles])
        return sum(dropped)

    def snapshot(self) -> dict[str, Any]:
        tasks = ray.get(self.units[0].controllers.remote())
        states = ray.get([h.snapshot.remote() for h in tasks.values()])
        storage = merge_snapshots(ray.get([unit.snapshot.remote() for unit in self.units]))
        return {"storage": storage, "tasks": dict(zip(tasks, states, strict=True))}

    def restore(self, state: dict[str, Any]) -> None:
        parts = split_snapshot(state["storage"], len(self.units))
        ray.get([unit.restore.remote(part) for unit, part in zip(self.units, parts, strict=True)])
        for task, ctl_state in state["tasks"].items():
            handle = ray.get(self.units[0].create_controller.remote(task, ctl_state["input_columns"]))
            ray.get(handle.restore.remote(ctl_state))
            ray.get([unit.add_controller.remote(task, handle, False) for unit in self.units])

    def stats(self) -> dict[str, Any]:
        tasks = ray.get(self.units[0].controllers.remote())
        units = ray.get([unit.stats.remote() for unit in self.units])
        states = ray.get([h.stats.remote() for h in tasks.values()])
        return {"rows": sum(u["rows"] for u in units), "units": units, "tasks": dict(zip(tasks, states, strict=True))}

    def close(self) -> None:
        tasks = ray.get(self.units[0].controllers.remote())
        ray.get([h.close.remote() for h in tasks.values()])

    def shutdown(self) -> None:
        """Kill the queue's actors (controllers first); the data is gone."""
        for handle in ray.get(self.units[0].controllers.remote()).values():
            ray.kill(handle)
        for unit in self.units:
            ray.kill(unit)

    def _controller(self, task: str) -> Any:
        if task not in self.task_handles:
            handle = ray.get(self.units[0].controllers.remote()).get(task)
            if handle is None:
                raise KeyError(f"task {task!r} is not registered")
            self.task_handles[task] = handle
        return self.task_handles[task]

    def write_refs(
        self, indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[RowMeta] | None
    ) -> list[Any]:
        """One write call per storage unit holding some of the rows."""
        check_put(indices, columns, meta)
        refs = []
        for unit, positions in partition(indices, len(self.units)).items():
            sub_meta = None if meta is None else [meta[p] for p in positions]
            sub_indices = [indices[p] for p in positions]
            sub_columns = select_rows(columns, positions, pack=True)  # numpy buffers on the wire, not int objects
            refs.append(self.units[unit].write.remote(sub_indices, sub_columns, sub_meta))
        return refs

    def read_refs(
        self, metas: Sequence[RowMeta], columns: Sequence[str]
    ) -> tuple[dict[int, list[int]], dict[int, Any]]:
        """Positions per unit and one read call per unit for the chosen rows."""
        chosen = [m.index for m in metas]
        positions = partition(chosen, len(self.units))
        refs = {u: self.units[u].read.remote([chosen[p] for p in pos], list(columns)) for u, pos in positions.items()}
        return positions, refs

    def drop_refs(self, indices: Sequence[int]) -> list[Any]:
        return [
            self.units[u].drop.remote([indices[p] for p in pos])
            for u, pos in partition(indices, len(self.units)).items()
        ]


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
        self, indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[RowMeta] | None = None
    ) -> None:
        await asyncio.gather(*self.queue.write_refs(indices, columns, meta))

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
    ) -> Batch:
        wanted = None if indices is None else list(indices)
        handle = await self._controller(task)
        metas = await handle.select.remote(list(columns), batch_size, policy, wanted, min_size, timeout)
        positions, refs = self.queue.read_refs(metas, columns)
        parts = await asyncio.gather(*refs.values())
        return assemble(metas, positions, dict(zip(refs, parts, strict=True)), columns)

    async def clear(self, indices: Sequence[int] | None = None) -> int:
        handles = list((await self.queue.units[0].controllers.remote()).values())
        if indices is None:
            indices = common_rows(await asyncio.gather(*(h.consumed.remote() for h in handles)))
        dropped = await asyncio.gather(*self.queue.drop_refs(indices))
        await asyncio.gather(*(h.forget.remote(list(indices)) for h in handles))
        return sum(dropped)

    async def snapshot(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.queue.snapshot)

    async def restore(self, state: dict[str, Any]) -> None:
        await asyncio.to_thread(self.queue.restore, state)

    async def stats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.queue.stats)

    async def close(self) -> None:
        handles = (await self.queue.units[0].controllers.remote()).values()
        await asyncio.gather(*(h.close.remote() for h in handles))

    async def _controller(self, task: str) -> Any:
        if task not in self.queue.task_handles:
            handle = (await self.queue.units[0].controllers.remote()).get(task)
            if handle is None:
                raise KeyError(f"task {task!r} is not registered")
            self.queue.task_handles[task] = handle
        return self.queue.task_handles[task]


def assemble(
    metas: Sequence[RowMeta], positions: dict[int, list[int]], parts: dict[int, Any], columns: Sequence[str]
) -> Batch:
    data = scatter_back(parts, positions, columns, len(metas))
    return Batch(indices=tuple(m.index for m in metas), columns=data, meta=tuple(metas))


def common_rows(consumed: Sequence[set[int]]) -> list[int]:
    """Rows every task consumed (none if no task is registered)."""
    return sorted(set.intersection(*consumed)) if consumed else []
