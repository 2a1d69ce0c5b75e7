"""The TransferQueue on Ray: clients of the storage-unit and controller actors (``ray_actors``).

``RayQueue.create(num_storage_units)`` starts the storage-unit actors (``num_cpus=0``); each
``register_task`` has unit 0 start that task's controller actor (so the queue's actors share
its owner's lifetime) and registers it with every unit. Clients talk to controllers for metadata
and to storage units for data, directly: a put packs each unit's share of every variable-length
column into one flat buffer and writes the units in parallel (visible to every task when it
returns); a get has the task's controller select and mark rows (woken by the units' write
notifications, never polling), then reads them from the units in parallel and merges them in
batch order (``get_views``: a same-node reader keeps views of a unit's arena until its block
ends). Same-node calls go over Unix sockets (``direct``) and large buffers through shared-memory
arenas (``shm``); across nodes, or with ``shared_memory=False``, through Ray. docs/queue.md has
the design. ``RayQueue`` (blocking) and ``AsyncRayQueue`` (coroutines, for async actors) are
picklable; the semantics are ``LocalQueue``'s. It deliberately does not make
``snapshot``/``clear`` atomic across actors (take them while the pipeline is paused, e.g. at a step
boundary), survive the loss of a unit actor, or move data through the driver.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import ray

from sluice.api.queue import Batch, Partition, Policy, RowMeta, Shard
from sluice.queue import direct, shm
from sluice.queue.direct import DirectCall, fan_out, this_node
from sluice.queue.lifecycle import common_rows
from sluice.queue.packed import MetaRows, meta_array
from sluice.queue.ray_actors import _Storage
from sluice.queue.request import ReadRequest, check_put
from sluice.queue.storage import (
    merge_reads,
    merge_snapshots,
    placement,
    select_rows,
    split_snapshot,
    unit_of,
    with_partition,
)

logger = logging.getLogger(__name__)


class RayQueue:
    """Blocking TransferQueue client over Ray actors (implements ``sluice.api.queue.QueueClient``).

    Picklable. Do not call it from an async actor's event loop; wrap it in ``AsyncRayQueue`` (``ray_async.py``) there.
    """

    def __init__(
        self, units: Sequence[Any], free_consumed: bool = False, endpoints: Sequence[tuple[str, str]] | None = None
    ) -> None:
        self.units = list(units)
        self.free_consumed = free_consumed
        # per unit: (node id, direct-call address); node "" means: always through Ray
        self.unit_endpoints = list(endpoints) if endpoints is not None else [("", "")] * len(self.units)
        self.task_handles: dict[str, Any] = {}  # cache: task -> controller handle
        self.task_endpoints: dict[str, tuple[str, str]] = {}

    @classmethod
    def create(
        cls,
        num_storage_units: int = 1,
        tasks: Mapping[str, Sequence[str]] | None = None,
        free_consumed: bool = False,
        shared_memory: bool = True,
    ) -> RayQueue:
        """Start the storage-unit actors on the connected Ray cluster (and ``tasks``' controllers).

        ``shared_memory``: between processes of one node, move bulk bytes through ``/dev/shm``
        arenas and make calls over Unix sockets (``direct``); else, and always across nodes,
        everything goes through Ray.
        """
        if num_storage_units < 1:
            raise ValueError("num_storage_units must be >= 1")
        if not ray.is_initialized():
            raise RuntimeError("ray.init() first")
        units = [_Storage.remote(num_storage_units, free_consumed, shared_memory) for _ in range(num_storage_units)]
        endpoints = ray.get([u.endpoint.remote() for u in units]) if shared_memory else None
        queue = cls(units, free_consumed, endpoints)
        for task, input_columns in (tasks or {}).items():
            queue.register_task(task, input_columns)
        return queue

    def register_task(self, task: str, input_columns: Sequence[str]) -> None:
        handle = ray.get(self.units[0].create_controller.remote(task, list(input_columns)))
        ray.get([unit.add_controller.remote(task, handle, True) for unit in self.units])
        self.task_handles[task] = handle

    def put(
        self,
        indices: Sequence[int],
        columns: Mapping[str, Sequence[Any]],
        meta: Sequence[RowMeta] | None = None,
        *,
        partition: Partition | None = None,
    ) -> None:
        calls, slots = self.write_calls(indices, columns, meta, partition)
        try:
            fan_out(calls)
        finally:
            if slots:
                shm.outbox().free(slots)

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
        partition: int | None = None,
        shard: Shard | None = None,
    ) -> Batch:
        req = ReadRequest.of(task, columns, batch_size, policy, indices, min_size, partition, shard)
        batch, used = self._read(req, timeout, copy=True)
        self._release(used)
        return batch

    @contextlib.contextmanager
    def get_views(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        timeout: float | None = None,
        partition: int | None = None,
        shard: Shard | None = None,
    ) -> Iterator[Batch]:
        """A fifo ``get`` without the copy out of the units' arenas: packed columns one unit read
        on this node stay views of its shared memory, valid until the block ends (then its slots
        go back to the unit). Copy whatever must outlive the block."""
        req = ReadRequest.of(task, columns, batch_size, "fifo", None, None, partition, shard)
        batch, used = self._read(req, timeout, copy=False)
        try:
            yield batch
        finally:
            self._release(used)

    def _read(self, req: ReadRequest, timeout: float | None, copy: bool) -> tuple[Batch, dict[int, list[int]]]:
        address = self._controller_address(req.task)
        if address:
            rows, done = direct.call(address, "select", req, timeout)
        else:
            rows, done = ray.get(self._controller(req.task).select.remote(req, timeout))
        metas = MetaRows(rows)
        positions, calls = self.read_calls(req.task, metas, req.columns)
        parts = dict(zip(calls, fan_out(list(calls.values())), strict=True))
        return _batch(metas, positions, parts, req.columns, done, copy)

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
        units = ray.get([unit.snapshot.remote() for unit in self.units])
        partitions = sorted({(pid, n) for u in units for pid, n in u["partitions"]})
        return {
            "storage": merge_snapshots(units),
            "tasks": dict(zip(tasks, states, strict=True)),
            "partitions": partitions,
            "ledger": [row for u in units for row in u["ledger"]],
        }

    def restore(self, state: dict[str, Any]) -> None:
        parts = split_snapshot(state["storage"], len(self.units))
        for part in parts:
            part["partitions"] = state["partitions"]
            part["ledger"] = []
        for row in state["ledger"]:
            parts[unit_of(row[0], len(self.units))]["ledger"].append(row)
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

    def controllers(self) -> dict[str, Any]:
        """Each task's controller actor (task -> handle)."""
        return dict(ray.get(self.units[0].controllers.remote()))

    def close(self) -> None:
        tasks = ray.get(self.units[0].controllers.remote())
        ray.get([h.close.remote() for h in tasks.values()])

    def shutdown(self, silent: Collection[str] = ()) -> None:
        """Kill the queue's actors (controllers first); the data is gone. Works on a queue one of
        whose actors died (the run's error names it): the dead are skipped, the others killed
        (controllers die with the unit that created them). A unit 0 that does not answer (stopped
        or hung) is waited for once, at most 10 s, not again to close its transport; the actors
        in ``silent`` (Ray actor ids a watchdog found not answering) are not waited for at all."""

        def answers(handle: Any) -> bool:
            return handle._actor_id.hex() not in silent

        units = self.units
        try:  # a stopped unit 0 never answers: its controllers die with it when it is killed
            if not answers(self.units[0]):
                raise ray.exceptions.GetTimeoutError
            controllers = list(ray.get(self.units[0].controllers.remote(), timeout=10.0).values())
        except ray.exceptions.RayActorError:
            controllers = []
        except ray.exceptions.GetTimeoutError:  # and it is not waited for a second time below
            controllers, units = [], self.units[1:]
        closing = [h.close_transport.remote() for h in [*controllers, *units] if answers(h)]
        if closing:  # a dead one's error is not this call's
            ray.wait(closing, num_returns=len(closing), timeout=10.0)
        for handle in [*controllers, *self.units]:
            ray.kill(handle)

    def _local(self, unit: int) -> bool:
        """Whether unit ``unit`` shares this process's node (then: shared memory and direct calls)."""
        node = self.unit_endpoints[unit][0]
        return bool(node) and node == this_node()

    def _controller_address(self, task: str) -> str:
        """The task's controller's direct-call address if it is on this node, else ``""``."""
        if not self.unit_endpoints[0][0]:
            return ""
        if task not in self.task_endpoints:
            self.task_endpoints[task] = ray.get(self._controller(task).endpoint.remote())
        node, address = self.task_endpoints[task]
        return address if node == this_node() else ""

    def _controller(self, task: str) -> Any:
        if task not in self.task_handles:
            handle = ray.get(self.units[0].controllers.remote()).get(task)
            if handle is None:
                raise KeyError(f"task {task!r} is not registered")
            self.task_handles[task] = handle
        return self.task_handles[task]

    def write_refs(
        self,
        indices: Sequence[int],
        columns: Mapping[str, Sequence[Any]],
        meta: Sequence[RowMeta] | None,
        partition: Partition | None,
    ) -> tuple[list[Any], list[int]]:
        """One Ray write call per storage unit holding some of the rows, and the outbox slots to free after."""
        shares, slots = self._shares(indices, columns, meta, partition)
        return [self.units[u].write.remote(*share) for u, share in shares], slots

    def write_calls(
        self,
        indices: Sequence[int],
        columns: Mapping[str, Sequence[Any]],
        meta: Sequence[RowMeta] | None,
        partition: Partition | None,
    ) -> tuple[list[Callable[[], Any]], list[int]]:
        """``write_refs`` as blocking calls: direct to same-node units, through Ray otherwise."""
        shares, slots = self._shares(indices, columns, meta, partition)
        calls: list[Callable[[], Any]] = []
        for u, share in shares:
            if self._local(u):
                calls.append(DirectCall(self.unit_endpoints[u][1], "write", share))
            else:
                calls.append(functools.partial(ray.get, self.units[u].write.remote(*share)))
        return calls, slots

    def _shares(
        self,
        indices: Sequence[int],
        columns: Mapping[str, Sequence[Any]],
        meta: Sequence[RowMeta] | None,
        partition: Partition | None,
    ) -> tuple[list[tuple[int, tuple[Any, ...]]], list[int]]:
        """Each unit's write arguments (packed; big buffers in this process's arena when on its node)."""
        check_put(indices, columns, meta)
        if partition is not None:
            meta = with_partition(indices, meta, partition)
        shares, slots = [], []
        metas = None if meta is None else meta_array(meta)
        for unit, positions in placement(indices, len(self.units)).items():
            sub_meta = None if metas is None else metas[positions]
            sub_indices = [indices[p] for p in positions]
            local = self._local(unit)
            # numpy buffers on the wire, not int objects; on this node packed straight into the arena
            sub_columns = select_rows(columns, positions, pack=True, alloc=shm.outbox().buffer_for if local else None)
            if local:
                sub_columns, used = shm.to_wire(sub_columns, shm.outbox())
                slots += used
            shares.append((unit, (sub_indices, sub_columns, sub_meta, partition)))
        return shares, slots

    def read_refs(
        self, task: str, metas: MetaRows, columns: Sequence[str]
    ) -> tuple[dict[int, list[int]], dict[int, Any]]:
        """Positions per unit and one Ray read call per unit for the chosen rows."""
        positions, args = self._read_args(task, metas, columns)
        return positions, {u: self.units[u].read.remote(*a) for u, a in args.items()}

    def read_calls(
        self, task: str, metas: MetaRows, columns: Sequence[str]
    ) -> tuple[dict[int, list[int]], dict[int, Callable[[], Any]]]:
        """``read_refs`` as blocking calls: direct to same-node units, through Ray otherwise."""
        positions, args = self._read_args(task, metas, columns)
        calls: dict[int, Callable[[], Any]] = {}
        for u, a in args.items():
            if self._local(u):
                calls[u] = DirectCall(self.unit_endpoints[u][1], "read", a)
            else:
                calls[u] = functools.partial(ray.get, self.units[u].read.remote(*a))
        return positions, calls

    def _read_args(
        self, task: str, metas: MetaRows, columns: Sequence[str]
    ) -> tuple[dict[int, list[int]], dict[int, tuple[Any, ...]]]:
        chosen = metas.indices()
        positions = placement(chosen, len(self.units))
        release = task if self.free_consumed else None
        args = {u: ([chosen[p] for p in pos], list(columns), release, self._local(u)) for u, pos in positions.items()}
        return positions, args

    def assemble(
        self,
        metas: MetaRows,
        positions: dict[int, list[int]],
        parts: dict[int, Any],
        columns: Sequence[str],
        done: bool,
    ) -> Batch:
        """The batch from the units' answers; arena slots are copied out, then released."""
        batch, used = _batch(metas, positions, parts, columns, done, copy=True)
        self._release(used)
        return batch

    def _release(self, slots: dict[int, list[int]]) -> None:
        """Give the units' arena slots back: direct calls on their node, all at once (~60 us against
        a Ray call's ~1 ms of CPU on each side, once per read), else Ray calls nobody waits for."""
        calls: list[Callable[[], Any]] = []
        for unit, used in slots.items():
            if self._local(unit):
                calls.append(DirectCall(self.unit_endpoints[unit][1], "release", (used,)))
            else:
                self.units[unit].release.remote(used)
        fan_out(calls)

    def drop_refs(self, indices: Sequence[int]) -> list[Any]:
        return [
            self.units[u].drop.remote([indices[p] for p in pos])
            for u, pos in placement(indices, len(self.units)).items()
        ]


def _batch(
    metas: MetaRows,
    positions: dict[int, list[int]],
    parts: dict[int, Any],
    columns: Sequence[str],
    done: bool,
    copy: bool,
) -> tuple[Batch, dict[int, list[int]]]:
    """The batch from the units' answers (packed columns copied out of the arenas if ``copy``, else
    views where one unit answered in order) and the arena slots it used, per unit."""
    local: dict[int, Any] = {}
    used: dict[int, list[int]] = {}
    for unit, part in parts.items():
        local[unit], by_segment = shm.from_wire(part, copy=copy and len(parts) == 1)
        if slots := [s for seg in by_segment.values() for s in seg]:
            used[unit] = slots
    data = merge_reads(local, positions, columns, len(metas))  # several units: gathered, a copy
    return Batch(indices=tuple(metas.indices()), columns=data, meta=metas, done=done), used
