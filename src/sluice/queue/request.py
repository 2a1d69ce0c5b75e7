"""What a read asks for and how long it may wait: shared by the in-process and Ray backends.

``ReadRequest`` bundles a ``get``'s arguments (it crosses to the Ray controller actor as one
object); ``select`` runs it against a ``TaskController``; the helpers turn a timeout into a
deadline and decide how many rows a waiting read still needs. Puts are validated here once,
before any storage unit is written. Nothing here waits or locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.api.queue import Policy, RowMeta, Shard
from sluice.queue.controller import TaskController
from sluice.queue.storage import check_aligned


@dataclass(frozen=True)
class ReadRequest:
    """The arguments of one ``get`` (see ``sluice.api.queue.QueueClient.get``)."""

    task: str
    columns: tuple[str, ...]
    batch_size: int
    policy: str | Policy = "fifo"
    indices: tuple[int, ...] | None = None
    min_size: int | None = None
    partition: int | None = None
    shard: Shard | None = None

    @staticmethod
    def of(
        task: str,
        columns: Sequence[str],
        batch_size: int,
        policy: str | Policy,
        indices: Sequence[int] | None,
        min_size: int | None,
        partition: int | None,
        shard: Shard | None,
    ) -> ReadRequest:
        if min_size is not None and not 0 <= min_size <= batch_size:
            raise ValueError(f"need 0 <= min_size ({min_size}) <= batch_size ({batch_size})")
        if shard is not None and partition is None:
            raise ValueError("a shard read needs a partition")
        wanted = None if indices is None else tuple(indices)
        return ReadRequest(task, tuple(columns), batch_size, policy, wanted, min_size, partition, shard)


def select(ctl: TaskController, req: ReadRequest, closed: bool, deadline: float | None) -> list[RowMeta] | None:
    """One selection attempt; ``None`` means: wait for more writes (never once closed or past the deadline)."""
    need = needed(req.batch_size, req.min_size, closed, deadline)
    return ctl.select(req.columns, req.batch_size, req.policy, req.indices, need, req.partition, req.shard)


def is_done(ctl: TaskController, req: ReadRequest, closed: bool, served: int) -> bool:
    """``Batch.done``: the partition (or shard) owes this task nothing more; without one, closed and empty."""
    if req.partition is None:
        return closed and served == 0
    return ctl.done(req.partition, req.shard)


def check_put(indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[RowMeta] | None) -> None:
    """Reject malformed puts before any unit is written (shared by both backends)."""
    if len(set(indices)) != len(indices):
        raise ValueError("duplicate indices in one put")
    check_aligned(indices, columns, meta)


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + max(0.0, timeout)


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def needed(batch_size: int, min_size: int | None, closed: bool, deadline: float | None) -> int:
    """Rows a get needs before it returns: ``min_size`` (default ``batch_size``), 0 once it may not wait."""
    if closed or (deadline is not None and time.monotonic() >= deadline):
        return 0
    return batch_size if min_size is None else min_size


def resolve(fut: asyncio.Future[None]) -> None:
    """Complete a waiter's future (idempotent)."""
    if not fut.done():
        fut.set_result(None)
