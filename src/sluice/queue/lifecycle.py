"""Row lifecycle of the TransferQueue: which rows every task consumed, and which rows are gone.

``ConsumptionLedger`` counts, per stored row, the tasks that consumed it; once every registered
task has, the row can be freed (the queue's ``free_consumed`` mode: memory stays bounded by the
rows in flight, however long the run). ``FreedRows`` remembers freed indices as merged ranges, so
a late write to a freed row (a task writing an output column nobody reads any more) is dropped
instead of resurrecting half a row; since indices are allocated in increasing order it stays a
handful of ranges.

It deliberately holds no data and no task state beyond names; the storage units and clients
call it under their own locks.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Sequence
from typing import Any


def common_rows(consumed: Sequence[set[int]]) -> list[int]:
    """Rows every task consumed (none if no task is registered)."""
    return sorted(set.intersection(*consumed)) if consumed else []


class FreedRows:
    """A set of one storage unit's row indices, stored as sorted, merged half-open ranges of keys.

    The unit holds blocks of ``block`` consecutive rows, every ``num_units``-th block
    (``storage.unit_of``); ``key`` numbers its own rows consecutively, so its freed rows still
    merge into a few ranges.
    """

    def __init__(self, num_units: int = 1, block: int = 1) -> None:
        self.num_units = num_units
        self.block = block
        self._units: set[int] = set()  # the unit of the rows seen (one value for a storage unit)
        self._starts: list[int] = []
        self._ends: list[int] = []

    def _unit(self, i: int) -> int:
        return (i // self.block) % self.num_units

    def _key(self, i: int) -> int:
        return i // (self.block * self.num_units) * self.block + i % self.block

    def add(self, indices: Iterable[int]) -> None:
        indices = list(indices)
        self._units.update(self._unit(i) for i in indices)
        if len(self._units) > 1:
            raise ValueError(f"FreedRows({self.num_units} units) got rows of several units {sorted(self._units)}")
        run_start = run_end = None
        for i in sorted({self._key(i) for i in indices}):
            if run_end is not None and i == run_end:
                run_end += 1
                continue
            if run_start is not None and run_end is not None:
                self._add_range(run_start, run_end)
            run_start, run_end = i, i + 1
        if run_start is not None and run_end is not None:
            self._add_range(run_start, run_end)

    def _add_range(self, start: int, end: int) -> None:
        lo = bisect.bisect_left(self._ends, start)  # first range that ends at or after start
        hi = bisect.bisect_right(self._starts, end)  # ranges starting at or before end overlap/touch
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]

    def __contains__(self, i: object) -> bool:
        if not isinstance(i, int) or (self._units and self._unit(i) not in self._units):
            return False
        key = self._key(i)
        k = bisect.bisect_right(self._starts, key) - 1
        return k >= 0 and key < self._ends[k]

    def __len__(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    @property
    def num_ranges(self) -> int:
        return len(self._starts)

    def indices(self) -> list[int]:
        """Every freed index, explicitly (for a checkpoint)."""
        (unit,) = self._units or {0}
        b, stride = self.block, self.block * self.num_units
        keys = (k for s, e in zip(self._starts, self._ends, strict=True) for k in range(s, e))
        return [k // b * stride + unit * b + k % b for k in keys]


class ConsumptionLedger:
    """Tasks that consumed each live row; reports rows every task consumed (to be freed)."""

    def __init__(self) -> None:
        self._by_row: dict[int, set[str]] = {}

    def consumed(self, task: str, indices: Iterable[int], tasks: Collection[str]) -> list[int]:
        """Record that ``task`` consumed ``indices``; returns those now consumed by all of ``tasks``."""
        done = []
        for i in indices:
            seen = self._by_row.setdefault(i, set())
            seen.add(task)
            if len(seen) >= len(tasks) and all(t in seen for t in tasks):
                done.append(i)
                del self._by_row[i]
        return done

    def forget(self, indices: Iterable[int]) -> None:
        for i in indices:
            self._by_row.pop(i, None)

    def __len__(self) -> int:
        return len(self._by_row)

    def snapshot(self) -> list[list[Any]]:
        return [[i, sorted(tasks)] for i, tasks in self._by_row.items()]

    def restore(self, rows: Sequence[Sequence[Any]]) -> None:
        for i, tasks in rows:
            self._by_row.setdefault(int(i), set()).update(tasks)
