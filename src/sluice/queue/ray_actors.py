"""The Ray actors of the TransferQueue: one per storage unit, one controller per task.

Both are threaded actors (``max_concurrency``): a Ray call into a threaded actor costs about half
as much as into an asyncio actor here, and a controller thread can wait for rows on an event
without blocking other calls. A ``StorageActor`` stores writes and then, before it acknowledges,
notifies the controller of every task that reads one of the written columns (a put costs one
call per reading task, not one per registered task); with ``free_consumed`` it counts which
tasks read each row and frees rows every task read. Unit 0 also starts the controllers, so the
queue's actors share its owner's lifetime. Each answers ``heartbeat`` in the ``HEALTH`` group
(``api/health.py``): a stopped unit or controller is named by the run's watchdog. Clients are in
``ray_backend``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

from sluice.api.health import HEALTH
from sluice.api.queue import Partition
from sluice.queue import shm
from sluice.queue.client import declare
from sluice.queue.controller import TaskController
from sluice.queue.direct import DirectCall, DirectServer, fan_out
from sluice.queue.lifecycle import ConsumptionLedger
from sluice.queue.packed import PARTITION_FIELD, MetaRows, PackedColumn, array_to_metas, metas_to_array
from sluice.queue.request import ReadRequest, deadline_of, is_done, remaining, select
from sluice.queue.storage import InMemoryStorageUnit, group_by_columns

logger = logging.getLogger(__name__)

CONTROLLER_THREADS = 256
"""Concurrent calls a controller actor serves; each waiting ``get`` holds one thread."""


class ControllerActor:
    """One task's controller as a threaded actor: selection with server-side waiting."""

    DIRECT_METHODS = ("notify_ready", "select")

    def __init__(self, task: str, input_columns: Sequence[str]) -> None:
        self._ctl = TaskController(task, input_columns)
        self._lock = threading.Lock()
        self._closed = False
        self._notifications = 0  # write notifications received: control-plane traffic
        self._direct = DirectServer(self)

    def endpoint(self) -> tuple[str, str]:
        """(node id, direct-call address) for same-node callers."""
        return str(ray.get_runtime_context().get_node_id()), self._direct.address

    def input_columns(self) -> tuple[str, ...]:
        return self._ctl.input_columns

    def notify_ready(self, rows: np.ndarray, columns: list[str], partitions: dict[int, int]) -> None:
        """``rows``: the written rows' metas (``metas_to_array``)."""
        metas = array_to_metas(rows)  # made outside the lock
        with self._lock:
            self._notifications += 1
            self._ctl.declare(partitions)
            self._ctl.notify_ready(metas, columns)

    def select(self, req: ReadRequest, timeout: float | None) -> tuple[np.ndarray, bool]:
        """The chosen rows (now consumed; ``metas_to_array``) and ``Batch.done``; waits as ``get`` says."""
        deadline = deadline_of(timeout)
        event = threading.Event()
        while True:
            with self._lock:
                metas = select(self._ctl, req, self._closed, deadline)
                if metas is not None:
                    return metas_to_array(metas), is_done(self._ctl, req, self._closed, len(metas))
                event.clear()
                self._ctl.add_waiter(event.set)
            try:
                event.wait(remaining(deadline))
            finally:
                with self._lock:
                    self._ctl.remove_waiter(event.set)

    def consumed(self) -> set[int]:
        with self._lock:
            return self._ctl.consumed

    def forget(self, indices: list[int]) -> None:
        with self._lock:
            self._ctl.forget(indices)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._ctl.snapshot()

    def restore(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._ctl.restore(state)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._ctl.stats(), "notifications": self._notifications}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._ctl.wake()

    def close_transport(self) -> None:
        self._direct.close()

    def heartbeat(self) -> float:
        return time.process_time()  # in the HEALTH group: answered while gets wait


class StorageActor:
    """One storage unit as a threaded actor; notifies the reading tasks' controllers of writes (and of frees)."""

    DIRECT_METHODS = ("write", "read", "release")

    def __init__(self, num_units: int, free_consumed: bool, shared_memory: bool = True) -> None:
        self._direct = DirectServer(self)
        self._node = str(ray.get_runtime_context().get_node_id())
        self._unit = InMemoryStorageUnit(num_units=num_units)
        self._arena = shm.Arena() if shared_memory else None  # answers same-node reads
        self._lock = threading.Lock()
        self._controllers: dict[str, Any] = {}  # task -> controller handle, notified on writes
        self._direct_to: dict[str, str] = {}  # task -> its controller's direct address (same node only)
        self._inputs: dict[str, frozenset[str]] = {}  # task -> its input columns
        self._told: dict[str, set[int]] = {}  # task -> partitions declared to its controller
        self._owned: dict[str, Any] = {}  # controllers this unit started (unit 0 only)
        self._partitions: dict[int, int] = {}
        self._ledger = ConsumptionLedger() if free_consumed else None
        self._written = [0, 0]  # rows, and the bytes of their packed columns
        self._forgets: list[Any] = []  # forget calls sent, maybe not yet applied (``stats`` waits)

    def create_controller(self, task: str, input_columns: list[str]) -> Any:
        """Start the task's controller once; later calls must name the same columns."""
        handle = self._owned.get(task)
        if handle is None:
            handle = self._owned[task] = _Controller.remote(task, input_columns)
            return handle
        existing = ray.get(handle.input_columns.remote())
        if existing != tuple(dict.fromkeys(input_columns)):
            raise ValueError(f"task {task!r} already registered with {existing}")
        return handle

    def controllers(self) -> dict[str, Any]:
        return dict(self._owned)

    def endpoint(self) -> tuple[str, str]:
        """(node id, direct-call address) for same-node callers."""
        return self._node, self._direct.address

    def add_controller(self, task: str, handle: Any, show_rows: bool) -> None:
        """Notify ``handle`` of every later write (and, with ``show_rows``, of the rows held now)."""
        node, address = ray.get(handle.endpoint.remote())
        inputs = frozenset(ray.get(handle.input_columns.remote()))
        with self._lock:
            if task in self._controllers:
                return
            self._controllers[task] = handle
            self._inputs[task] = inputs
            self._told[task] = set(self._partitions)
            if node == self._node:
                self._direct_to[task] = address
            groups = group_by_columns(self._unit.catalog()) if show_rows else {}
            partitions = dict(self._partitions)
        calls = [
            handle.notify_ready.remote(metas_to_array(metas), list(names), partitions)
            for names, metas in groups.items()
        ]
        ray.get(calls or [handle.notify_ready.remote(metas_to_array([]), [], partitions)])

    def _notify(self, targets: list[tuple[str, Any, dict[int, int]]], rows: np.ndarray, names: list[str]) -> None:
        """Tell the controllers (with the partitions each has not heard of) that ``rows`` now
        hold ``names``: in parallel, directly when on this node."""
        calls: list[Callable[[], Any]] = []
        for task, handle, declared in targets:
            if task in self._direct_to:
                calls.append(DirectCall(self._direct_to[task], "notify_ready", (rows, names, declared)))
            else:
                calls.append(functools.partial(ray.get, handle.notify_ready.remote(rows, names, declared)))
        fan_out(calls)

    def _targets(self, names: list[str], partitions: set[int]) -> list[tuple[str, Any, dict[int, int]]]:
        """The controllers whose task reads one of ``names``, each with the declarations of
        ``partitions`` it has not received yet (a task that reads none of the columns learns of a
        partition with its first rows, so a put costs one call per reading task, not per task).
        Call under the lock."""
        targets = []
        for task, handle in self._controllers.items():
            if self._inputs[task].isdisjoint(names):
                continue
            told = self._told[task]
            new = {pid: self._partitions[pid] for pid in partitions - told if pid in self._partitions}
            told.update(new)
            targets.append((task, handle, new))
        return targets

    def write(
        self, indices: list[int], columns: dict[str, Sequence[Any]], meta: np.ndarray | None, part: Partition | None
    ) -> None:
        """Store the rows (``meta``: ``metas_to_array`` or ``None``), then notify every controller.

        Columns that arrive in the sender's arena (``shm.ShmPacked``) are copied out before the ack.
        """
        columns, _ = shm.from_wire(columns, copy=True)
        with self._lock:
            self._written[0] += len(indices)
            self._written[1] += sum(col.nbytes for col in columns.values() if isinstance(col, PackedColumn))
            if part is not None:
                declare(self._partitions, part)
            wire = self._unit.write(indices, columns, None if meta is None else MetaRows(meta)).array
            partitions = {int(p) for p in np.unique(wire[:, PARTITION_FIELD]) if p >= 0}
            targets = self._targets(list(columns), partitions)
        self._notify(targets, wire, list(columns))

    def read(self, indices: list[int], columns: list[str], task: str | None, via_shm: bool) -> dict[str, Any]:
        """The rows' columns (``via_shm``: packed ones in this unit's arena, freed by ``release``);
        ``task`` (``free_consumed`` mode) records that it consumed them."""
        with self._lock:
            into = self._arena.buffer_for if via_shm and self._arena is not None else None
            data = dict(self._unit.read(indices, columns, into))  # gathered straight into the arena
            freed: list[int] = []
            if self._ledger is not None and task is not None:
                freed = self._ledger.consumed(task, indices, self._controllers)
                self._unit.drop(freed)
            handles = list(self._controllers.values())
            if via_shm and self._arena is not None:
                data, _ = shm.to_wire(data, self._arena)
        sent = [h.forget.remote(freed) for h in (handles if freed else [])]  # reads need not wait
        if sent:
            with self._lock:
                self._forgets = _unfinished(self._forgets) + sent
        return data

    def release(self, slots: list[int]) -> None:
        """A reader copied these arena slots out: they may be reused."""
        if self._arena is not None:
            self._arena.free(slots)

    def close_transport(self) -> None:
        if self._arena is not None:
            self._arena.close()
        self._direct.close()

    def drop(self, indices: list[int]) -> int:
        with self._lock:
            if self._ledger is not None:
                self._ledger.forget(indices)
            return self._unit.drop(indices)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            state = self._unit.snapshot()
            state["partitions"] = sorted(self._partitions.items())
            state["ledger"] = [] if self._ledger is None else self._ledger.snapshot()
            return state

    def restore(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._unit.restore(state)
            self._partitions.update((pid, n) for pid, n in state["partitions"])
            if self._ledger is not None:
                self._ledger.restore(state["ledger"])

    def stats(self) -> dict[str, Any]:
        """What the unit holds now, what it was written in all, and its process's CPU seconds; the
        controllers have applied every row this unit freed (their stats, asked next, agree)."""
        with self._lock:
            pending, self._forgets = self._forgets, []
        if pending:  # a dead controller's call counts as finished: stats never raise for it
            ray.wait(pending, num_returns=len(pending), timeout=10.0)
        with self._lock:
            rows, size = self._written
            return {**self._unit.stats(), "rows_written": rows, "bytes_written": size, "cpu_s": time.process_time()}

    def heartbeat(self) -> float:
        return time.process_time()  # in the HEALTH group, never behind the lock


def _unfinished(refs: list[Any]) -> list[Any]:
    return ray.wait(refs, num_returns=len(refs), timeout=0)[1] if refs else []


_Controller: Any = ray.remote(num_cpus=0, max_concurrency=CONTROLLER_THREADS, concurrency_groups={HEALTH: 1})(  # type: ignore[call-overload]
    ControllerActor
)
_Storage: Any = ray.remote(num_cpus=0, max_concurrency=16, concurrency_groups={HEALTH: 1})(StorageActor)  # type: ignore[call-overload]
