"""Per-task controllers of the TransferQueue: readiness, exactly-once consumption, partitions.

A ``TaskController`` is the metadata view of one task (AsyncFlow §3.3): for every row it knows
the ``RowMeta``, which of the task's input columns are still missing, and whether the task has
consumed it. Writes call ``notify_ready``; a read calls ``select``, which runs a policy
(``policies.py``) over the ready rows and marks the chosen rows consumed in the same step, so two
consumers of one task never get the same row. Rows move one way: pending → ready → consumed
(then ``forget`` once freed). It keeps incremental ready sets, never rescanning a status matrix.

Partitions (global batches) are counted per task: how many rows the partition will hold
(declared with the first put), how many this task has consumed; a task that consumed them all is
done with it, and a ``select`` never waits for more rows than the partition still owes. A
``Shard`` read waits until the whole partition is ready, splits it once with
``balance_shards`` (``shards.py``: equal row counts, near-equal tokens; the split is cached, so every rank sees
the same one) and serves that rank's part.

Waiting is the caller's: a waiter is a callable the controller invokes (without arguments, under
the caller's lock) whenever rows may have become selectable; the local client wakes threads or
futures with it, the Ray controller actor its threads. It deliberately holds no sample bytes, no
lock and no clock, and knows no storage unit.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass, field
from typing import Any

from sluice.api.queue import Policy, RowMeta, Shard
from sluice.queue.policies import POLICIES, fifo_policy, resolve_policy
from sluice.queue.shards import balance_shards

__all__ = ["POLICIES", "PartitionState", "TaskController", "Waiter", "resolve_policy"]

logger = logging.getLogger(__name__)

Waiter = Callable[[], None]


def columns_full(columns: Sequence[str] | set[str], inputs: frozenset[str]) -> bool:
    """Whether a get asks for all of a task's input columns (then readiness is the ready set)."""
    return inputs.issubset(columns)


@dataclass
class PartitionState:
    """One task's view of one partition: its rows' token counts, what is consumed, its shards."""

    expected: int | None = None
    tokens: dict[int, int] = field(default_factory=dict)  # row -> num_tokens, every row seen
    consumed: int = 0
    shards: dict[int, list[list[int]]] = field(default_factory=dict)  # shard count -> rows per shard
    ready_heap: list[int] = field(default_factory=list)  # its ready rows (stale entries skipped): fifo reads

    def remaining(self) -> int | None:
        return None if self.expected is None else self.expected - self.consumed


class TaskController:
    """Readiness and consumption of every row for one task; selection with a policy."""

    def __init__(self, task: str, input_columns: Sequence[str]) -> None:
        self.task = task
        self.input_columns = tuple(dict.fromkeys(input_columns))
        self._inputs = frozenset(self.input_columns)
        self._pending: dict[int, tuple[RowMeta, set[str]]] = {}  # row -> (meta, missing input columns)
        self._ready: dict[int, RowMeta] = {}  # all input columns written, not consumed
        self._consumed: set[int] = set()
        self._partitions: dict[int, PartitionState] = {}
        self._waiters: list[Waiter] = []
        self._ready_heap: list[int] = []  # ready indices, stale entries skipped: O(batch log n) fifo reads

    def declare(self, partitions: Mapping[int, int]) -> None:
        """Partition id -> expected row count (from a put); a different count for a known id is an error."""
        for pid, expected in partitions.items():
            state = self._partitions.setdefault(pid, PartitionState())
            if state.expected not in (None, expected):
                raise ValueError(f"partition {pid} declared with {expected} rows, earlier with {state.expected}")
            state.expected = expected
        if partitions:
            self.wake()

    def notify_ready(self, metas: Iterable[RowMeta], columns: Iterable[str]) -> None:
        """Rows ``metas`` now hold ``columns``; a later meta of a known row replaces the old one."""
        written = self._inputs.intersection(columns)
        changed = False
        for m in metas:
            i = m.index
            if i in self._consumed:
                continue
            if i in self._ready:
                if m.partition >= 0 and m.partition != self._ready[i].partition:
                    heapq.heappush(self._partitions.setdefault(m.partition, PartitionState()).ready_heap, i)
                self._ready[i] = m
                continue
            _, missing = self._pending.get(i, (m, None))
            if missing is None:
                missing = set(self._inputs)
                if m.partition >= 0:
                    self._partitions.setdefault(m.partition, PartitionState()).tokens[i] = m.num_tokens
            changed = changed or bool(missing & written)
            missing -= written
            if missing:
                self._pending[i] = (m, missing)
            else:
                self._pending.pop(i, None)
                self._ready[i] = m
                heapq.heappush(self._ready_heap, i)
                if m.partition >= 0:
                    heapq.heappush(self._partitions[m.partition].ready_heap, i)
                changed = True
        if changed:
            self.wake()

    def select(
        self,
        columns: Sequence[str],
        batch_size: int,
        policy: str | Policy = "fifo",
        indices: Sequence[int] | None = None,
        min_size: int = 0,
        partition: int | None = None,
        shard: Shard | None = None,
    ) -> list[RowMeta] | None:
        """Choose rows with ``policy`` and mark them consumed; ``None`` if fewer than ``min_size``.

        With a partition (or shard) that owes fewer than ``min_size`` rows, that many suffice.
        """
        if not 0 <= min_size <= batch_size:
            raise ValueError(f"need 0 <= min_size ({min_size}) <= batch_size ({batch_size})")
        unknown = set(columns) - self._inputs
        if unknown:
            raise ValueError(f"task {self.task!r} did not register columns {sorted(unknown)}")
        if shard is not None and (partition is None or not 0 <= shard.rank < shard.size):
            raise ValueError(f"a shard read needs a partition and 0 <= rank < size, got {partition}, {shard}")
        owed = self.owed(partition, shard)
        if owed == 0:
            return []
        if shard is not None:
            assert partition is not None
            indices = self._shard_rows(partition, shard)
            if indices is None:
                return None if min_size else []
            owed = self.owed(partition, shard)
        if owed is not None:
            min_size = min(min_size, owed)
        full = indices is None and partition is None and columns_full(columns, self._inputs)
        plain = indices is None and shard is None and columns_full(columns, self._inputs)
        if plain and resolve_policy(policy) is fifo_policy:  # the common read: no scan of every ready row
            return self._take_fifo(batch_size, min_size, partition)
        candidates = self._candidates(set(columns), indices, partition)
        if len(candidates) < min_size:
            return None
        chosen = resolve_policy(policy)(candidates, batch_size) if candidates else []
        if len(chosen) < min_size:
            return None
        # the usual case (all input columns, no restriction) chose from ``_ready``: check in O(chosen)
        allowed = self._ready if full else {m.index: m for m in candidates}
        if len(chosen) > batch_size or len(set(chosen)) != len(chosen) or any(i not in allowed for i in chosen):
            raise ValueError(f"policy {policy!r} chose rows outside the candidates or above batch_size")
        metas = [allowed[i] for i in chosen]
        for m in metas:
            if self._ready.pop(m.index, None) is None:
                del self._pending[m.index]
            self._consumed.add(m.index)
            if m.partition >= 0:
                self._consume_in_partition(m.partition)
        return metas

    def _take_fifo(self, batch_size: int, min_size: int, partition: int | None) -> list[RowMeta] | None:
        """``fifo_policy`` over the ready rows (of ``partition``), from a heap of ready indices."""
        if partition is None:
            if len(self._ready) < min_size:
                return None
            if len(self._ready_heap) > 2 * len(self._ready) + 64:  # mostly stale entries: rebuild
                self._ready_heap = sorted(self._ready)
            heap = self._ready_heap
        else:
            state = self._partitions.get(partition)
            if state is None:
                return None if min_size else []
            heap = state.ready_heap
        metas: list[RowMeta] = []
        while heap and len(metas) < batch_size:
            m = self._ready.get(heapq.heappop(heap))
            if m is not None and (partition is None or m.partition == partition):
                metas.append(m)
        if len(metas) < min_size:  # only a partition read gets here: put its rows back and wait
            for m in metas:
                heapq.heappush(heap, m.index)
            return None
        for m in metas:
            del self._ready[m.index]
            self._consumed.add(m.index)
            if m.partition >= 0:
                self._consume_in_partition(m.partition)
        return metas

    def _consume_in_partition(self, pid: int) -> None:
        state = self._partitions[pid]
        state.consumed += 1
        if state.remaining() == 0:  # done: keep only the counts
            state.tokens.clear()
            state.shards.clear()
            state.ready_heap.clear()

    def owed(self, partition: int | None, shard: Shard | None = None) -> int | None:
        """Rows of ``partition`` (or of its ``shard``) this task has still to consume; ``None``: unknown."""
        if partition is None:
            return None
        state = self._partitions.get(partition)
        if state is None:
            return None
        if shard is None or state.remaining() == 0:
            return state.remaining()
        rows = state.shards.get(shard.size)
        return None if rows is None else sum(i not in self._consumed for i in rows[shard.rank])

    def done(self, partition: int | None, shard: Shard | None = None) -> bool:
        """Whether this task will never be served another row of ``partition`` (or of its ``shard``)."""
        return self.owed(partition, shard) == 0

    def _shard_rows(self, partition: int, shard: Shard) -> list[int] | None:
        """This rank's rows of the partition's balanced split; ``None`` until the whole partition is in."""
        state = self._partitions.get(partition)
        if state is None or state.expected is None:
            return None
        if shard.size not in state.shards:
            if len(state.tokens) < state.expected or any(i in self._pending for i in state.tokens):
                return None
            rows = sorted(state.tokens)
            split = balance_shards([state.tokens[i] for i in rows], shard.size)
            state.shards[shard.size] = [[rows[k] for k in part] for part in split]
        return state.shards[shard.size][shard.rank]

    def _candidates(self, columns: set[str], indices: Sequence[int] | None, partition: int | None) -> list[RowMeta]:
        full = columns_full(columns, self._inputs)
        if indices is None:
            out = list(self._ready.values())
            if not full:
                out += [m for m, missing in self._pending.values() if not missing & columns]
        else:
            out = []
            for i in dict.fromkeys(indices):
                m = self._ready.get(i)
                if m is None and not full and i in self._pending:
                    meta, missing = self._pending[i]
                    m = None if missing & columns else meta
                if m is not None:
                    out.append(m)
        if partition is not None:
            out = [m for m in out if m.partition == partition]
        return out

    def add_waiter(self, waiter: Waiter) -> None:
        self._waiters.append(waiter)

    def remove_waiter(self, waiter: Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)

    def wake(self) -> None:
        """Call every waiter (they re-check with ``select``)."""
        for waiter in list(self._waiters):
            waiter()

    @property
    def consumed(self) -> set[int]:
        return set(self._consumed)

    def forget(self, indices: Iterable[int]) -> None:
        """Drop every trace of the rows (they were freed from storage); partition counts stay."""
        for i in indices:
            self._pending.pop(i, None)
            self._ready.pop(i, None)
            self._consumed.discard(i)

    def snapshot(self) -> dict[str, Any]:
        return {
            "input_columns": list(self.input_columns),
            "ready": [list(astuple(m)) for m in self._ready.values()],
            "pending": [[list(astuple(m)), sorted(missing)] for m, missing in self._pending.values()],
            "consumed": sorted(self._consumed),
            "partitions": [
                [pid, s.expected, sorted(s.tokens.items()), s.consumed, sorted(s.shards.items())]
                for pid, s in self._partitions.items()
            ],
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Replace readiness, consumption and partitions with a ``snapshot``'s."""
        if tuple(state["input_columns"]) != self.input_columns:
            raise ValueError(f"task {self.task!r}: snapshot columns {state['input_columns']} != {self.input_columns}")
        self._ready = {row[0]: RowMeta(*row) for row in state["ready"]}
        self._ready_heap = sorted(self._ready)
        self._pending = {row[0]: (RowMeta(*row), set(missing)) for row, missing in state["pending"]}
        self._consumed = set(state["consumed"])
        self._partitions = {
            pid: PartitionState(expected, {i: t for i, t in tokens}, consumed, {n: rows for n, rows in shards})
            for pid, expected, tokens, consumed, shards in state["partitions"]
        }
        for i, m in sorted(self._ready.items()):
            if m.partition >= 0:
                self._partitions.setdefault(m.partition, PartitionState()).ready_heap.append(i)
        self.wake()

    def stats(self) -> dict[str, int]:
        return {
            "ready": len(self._ready),
            "pending": len(self._pending),
            "consumed": len(self._consumed),
            "partitions": len(self._partitions),
            "waiting": len(self._waiters),
        }
