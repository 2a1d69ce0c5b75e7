"""Contracts of the TransferQueue: row metadata, the batch a task reads, and its three seams.

Every sample is a row addressed by a global integer index; columns are named fields that
different tasks write at different times (rollout writes ``tokens``, a reference task later
writes ``ref_logp``). A task registers the columns it reads and pulls rows whose columns are all
ready and that it has not consumed yet, exactly once per task. ``sluice.queue`` implements these
in-process (``LocalQueue``) and on Ray (``RayQueue``). This module holds shapes only: no
behaviour, no torch, no ray.

Grouping is carried by the rows themselves: ``RowMeta.group_size`` says how many rows share
``group_id``, so the ``"groups"`` policy stays a pure function of the candidate rows. A row may
belong to one global-batch ``Partition`` (``RowMeta.partition``), whose expected row count lets a
consumer tell "not yet" from "done" (``Batch.done``), and whose rows can be handed out in balanced
``Shard`` s to the ranks of a data-parallel stage (DistFlow's redistribution).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class RowMeta:
    """What a controller knows about a row, given once with the row's first put.

    ``group_size`` is the number of rows of ``group_id`` (prompt replication ``n``); a group is
    complete for the ``"groups"`` policy once that many of its rows are ready. ``version`` is
    the row's policy version (its oldest token's), ``num_tokens`` its length for balancing.
    """

    index: int
    group_id: int
    version: int
    num_tokens: int
    group_size: int = 1
    partition: int = -1  # global-batch partition id; -1: none

    def __reduce__(self) -> tuple[type[RowMeta], tuple[int, int, int, int, int, int]]:
        # a plain tuple on the wire: ~40x cheaper to pickle than the dataclass default
        return (RowMeta, (self.index, self.group_id, self.version, self.num_tokens, self.group_size, self.partition))


@dataclass(frozen=True)
class Partition:
    """A global batch: rows written with ``put(..., partition=...)`` join it; ``expected_rows`` is
    how many it will hold in all, so a task that consumed that many is done with it."""

    id: int
    expected_rows: int


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size`` ranks reading one partition: the partition's rows are split into
    ``size`` shards of equal row count (±1) and near-equal token count, the same split for every
    rank (DistFlow's redistribution between stages of different data-parallel sizes)."""

    rank: int
    size: int


@dataclass(frozen=True)
class Batch:
    """Rows returned by one ``get``: ``columns[name][k]`` belongs to row ``indices[k]``.

    Rows appear in the order the policy chose them (``"fifo"``: ascending index). A column of
    variable-length numeric rows is a ``sluice.queue.PackedColumn`` (one flat buffer plus
    offsets; a row materialises on access), any other column a list. ``done`` is True when this
    task will never get another row of the requested partition (all its expected rows consumed)
    or, without a partition, when the queue is closed.
    """

    indices: tuple[int, ...]
    columns: dict[str, Sequence[Any]]
    meta: Sequence[RowMeta]  # a tuple, or the queue's lazy ``MetaRows``
    done: bool = False

    def __len__(self) -> int:
        return len(self.indices)


Policy = Callable[[Sequence[RowMeta], int], list[int]]
"""A selection policy: ``(candidate rows, batch_size) -> chosen row indices`` (pure, ≤ batch_size)."""


@runtime_checkable
class QueueClient(Protocol):
    """The TransferQueue as seen by one process: write columns of rows, read ready rows per task."""

    def register_task(self, task: str, input_columns: Sequence[str]) -> None:
        """Create the task's controller; rows already written become visible to it."""
        ...

    def put(
        self,
        indices: Sequence[int],
        columns: Mapping[str, Sequence[Any]],
        meta: Sequence[RowMeta] | None = None,
        *,
        partition: Partition | None = None,
    ) -> None:
        """Write ``columns[name][k]`` to row ``indices[k]``; ``meta`` (aligned) with a row's first put.

        With ``partition``, the rows join it (their ``RowMeta.partition`` becomes its id).
        """
        ...

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
        """Up to ``batch_size`` ready rows not yet consumed by ``task``, now marked consumed.

        Waits (woken by writes, never polling) until ``min_size`` (default ``batch_size``) rows can
        be chosen, or ``timeout`` seconds pass, or the queue is closed; then returns what is ready.
        ``partition`` restricts the rows to one partition and stops waiting once it is done;
        ``shard`` (needs ``partition``) waits for the whole partition, then serves only this rank's
        shard of it.
        """
        ...

    def clear(self, indices: Sequence[int] | None = None) -> int:
        """Free rows (``None``: those every registered task consumed); returns how many."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Plain-data state (rows, metadata, readiness, consumption) for a checkpoint."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """Load a ``snapshot`` into a freshly created queue (its tasks come back with it)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters: rows stored, per task ready / pending / consumed / waiting."""
        ...

    def close(self) -> None:
        """Stop waiting: pending and later ``get`` calls return what is ready at once."""
        ...


@runtime_checkable
class AsyncQueueClient(Protocol):
    """``QueueClient`` as coroutines, for asyncio code (rollout workers, async actors)."""

    async def register_task(self, task: str, input_columns: Sequence[str]) -> None: ...

    async def put(
        self,
        indices: Sequence[int],
        columns: Mapping[str, Sequence[Any]],
        meta: Sequence[RowMeta] | None = None,
        *,
        partition: Partition | None = None,
    ) -> None: ...

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
    ) -> Batch: ...

    async def clear(self, indices: Sequence[int] | None = None) -> int: ...

    async def snapshot(self) -> dict[str, Any]: ...

    async def restore(self, state: dict[str, Any]) -> None: ...

    async def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


@runtime_checkable
class StorageUnit(Protocol):
    """Holds a slice of the rows (rows × columns) plus their ``RowMeta``; knows nothing of tasks."""

    def write(
        self, indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[RowMeta] | None = None
    ) -> Sequence[RowMeta]:
        """Store the values; returns the ``RowMeta`` of every written row (a default for new rows)."""
        ...

    def read(self, indices: Sequence[int], columns: Sequence[str]) -> dict[str, Sequence[Any]]:
        """Values of the given columns, aligned with ``indices``; ``KeyError`` if one is missing."""
        ...

    def drop(self, indices: Sequence[int]) -> int:
        """Forget the rows; returns how many were stored."""
        ...

    def catalog(self) -> list[tuple[RowMeta, tuple[str, ...]]]:
        """Every stored row with the names of the columns it holds (to bootstrap a late controller)."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Plain-data copy of the rows and their metadata: ``{"meta": [RowMeta fields as a list
        per row], "columns": {name: {"indices": [...], "values": [...]}}, "freed": [indices]}``."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """Add the rows of a ``snapshot``."""
        ...

    def stats(self) -> dict[str, Any]:
        """Rows and bytes held."""
        ...
