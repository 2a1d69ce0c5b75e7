"""Per-task controllers of the TransferQueue and the built-in selection policies.

A ``TaskController`` is the metadata view of one task (AsyncFlow §3.3): for every row it knows
the ``RowMeta``, which of the task's input columns are still missing, and whether the task has
consumed it. Writes call ``notify_ready``; a read calls ``select``, which runs a policy over the
ready rows and marks the chosen rows consumed in the same step, so two consumers of one task
never get the same row. Rows move one way: pending → ready → consumed (then ``forget`` on clear).
It keeps incremental ready sets, never rescanning a status matrix.

Waiting is the caller's: a waiter is a callable the controller invokes (without arguments, under
the caller's lock) whenever rows may have become selectable; the local client wakes threads or
futures with it, the Ray controller actor its futures.

It deliberately holds no sample bytes, no lock and no clock, and knows no storage unit.

Policies are pure functions ``(candidates, batch_size) -> chosen indices`` in ``POLICIES``:
``fifo`` (lowest index first), ``oldest_version`` (lowest ``version``, then index) and
``groups`` (whole groups only: a group is complete when ``group_size`` of its rows are
candidates, i.e. ready and not consumed; complete groups are taken oldest version first, then
by lowest index, while they fit in ``batch_size``; ``group_size`` travels in ``RowMeta``, so
groups of different sizes may share a queue).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple
from typing import Any

from sluice.api.queue import Policy, RowMeta

logger = logging.getLogger(__name__)


def fifo_policy(candidates: Sequence[RowMeta], batch_size: int) -> list[int]:
    """Lowest index first."""
    return heapq.nsmallest(batch_size, [m.index for m in candidates])


def oldest_version_policy(candidates: Sequence[RowMeta], batch_size: int) -> list[int]:
    """Lowest policy version first, ties by index (DESIGN.md: steps take the oldest rows first)."""
    return [i for _, i in heapq.nsmallest(batch_size, [(m.version, m.index) for m in candidates])]


def groups_policy(candidates: Sequence[RowMeta], batch_size: int) -> list[int]:
    """Whole groups only, oldest first; stops at the first complete group that does not fit.

    A group is complete once ``group_size`` of its rows are candidates; it contributes exactly
    ``group_size`` rows (its lowest indices; surplus rows wait for a later group). Raises
    ``ValueError`` if the oldest complete group alone exceeds ``batch_size`` (never servable).
    """
    groups: dict[int, list[RowMeta]] = {}
    for m in candidates:
        groups.setdefault(m.group_id, []).append(m)
    complete = [sorted(rows, key=lambda m: m.index)[: rows[0].group_size] for rows in groups.values()]
    complete = [rows for rows in complete if len(rows) == rows[0].group_size]
    complete.sort(key=lambda rows: (min(m.version for m in rows), rows[0].index))
    chosen: list[int] = []
    for rows in complete:
        if len(chosen) + len(rows) > batch_size:
            if not chosen and batch_size > 0:
                raise ValueError(f"group {rows[0].group_id} has {len(rows)} rows > batch_size {batch_size}")
            break
        chosen.extend(m.index for m in rows)
    return chosen


POLICIES: dict[str, Policy] = {
    "fifo": fifo_policy,
    "oldest_version": oldest_version_policy,
    "groups": groups_policy,
}


def resolve_policy(policy: str | Policy) -> Policy:
    """A policy from its name in ``POLICIES`` or the function itself."""
    if callable(policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; built-ins: {sorted(POLICIES)}")
    return POLICIES[policy]


Waiter = Callable[[], None]


def columns_full(columns: Sequence[str] | set[str], inputs: frozenset[str]) -> bool:
    """Whether a get asks for all of a task's input columns (then readiness is the ready set)."""
    return inputs.issubset(columns)


class TaskController:
    """Readiness and consumption of every row for one task; selection with a policy."""

    def __init__(self, task: str, input_columns: Sequence[str]) -> None:
        self.task = task
        self.input_columns = tuple(dict.fromkeys(input_columns))
        self._inputs = frozenset(self.input_columns)
        self._pending: dict[int, tuple[RowMeta, set[str]]] = {}  # row -> (meta, missing input columns)
        self._ready: dict[int, RowMeta] = {}  # all input columns written, not consumed
        self._consumed: set[int] = set()
        self._waiters: list[Waiter] = []

    def notify_ready(self, metas: Iterable[RowMeta], columns: Iterable[str]) -> None:
        """Rows ``metas`` now hold ``columns``; a later meta of a known row replaces the old one."""
        written = self._inputs.intersection(columns)
        changed = False
        for m in metas:
            i = m.index
            if i in self._consumed:
                continue
            if i in self._ready:
                self._ready[i] = m
                continue
            _, missing = self._pending.get(i, (m, None))
            missing = set(self._inputs) if missing is None else missing
            changed = changed or bool(missing & written)
            missing -= written
            if missing:
                self._pending[i] = (m, missing)
            else:
                self._pending.pop(i, None)
                self._ready[i] = m
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
    ) -> list[RowMeta] | None:
        """Choose rows with ``policy`` and mark them consumed; ``None`` if fewer than ``min_size``."""
        if not 0 <= min_size <= batch_size:
            raise ValueError(f"need 0 <= min_size ({min_size}) <= batch_size ({batch_size})")
        unknown = set(columns) - self._inputs
        if unknown:
            raise ValueError(f"task {self.task!r} did not register columns {sorted(unknown)}")
        candidates = self._candidates(set(columns), indices)
        if len(candidates) < min_size:
            return None
        chosen = resolve_policy(policy)(candidates, batch_size) if candidates else []
        if len(chosen) < min_size:
            return None
        # the usual case (all input columns, no restriction) chose from ``_ready``: check in O(chosen)
        full = indices is None and columns_full(columns, self._inputs)
        allowed = self._ready if full else {m.index: m for m in candidates}
        if len(chosen) > batch_size or len(set(chosen)) != len(chosen) or any(i not in allowed for i in chosen):
            raise ValueError(f"policy {policy!r} chose rows outside the candidates or above batch_size")
        metas = [allowed[i] for i in chosen]
        for i in chosen:
            if self._ready.pop(i, None) is None:
                del self._pending[i]
            self._consumed.add(i)
        return metas

    def _candidates(self, columns: set[str], indices: Sequence[int] | None) -> list[RowMeta]:
        full = columns_full(columns, self._inputs)
        if indices is None:
            out = list(self._ready.values())
            if not full:
                out += [m for m, missing in self._pending.values() if not missing & columns]
            return out
        out = []
        for i in dict.fromkeys(indices):
            m = self._ready.get(i)
            if m is None and not full and i in self._pending:
                meta, missing = self._pending[i]
                m = None if missing & columns else meta
            if m is not None:
                out.append(m)
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
        """Drop every trace of the rows (they were cleared from storage)."""
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
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Replace readiness and consumption with a ``snapshot``'s."""
        if tuple(state["input_columns"]) != self.input_columns:
            raise ValueError(f"task {self.task!r}: snapshot columns {state['input_columns']} != {self.input_columns}")
        self._ready = {row[0]: RowMeta(*row) for row in state["ready"]}
        self._pending = {row[0]: (RowMeta(*row), set(missing)) for row, missing in state["pending"]}
        self._consumed = set(state["consumed"])
        self.wake()

    def stats(self) -> dict[str, int]:
        return {
            "ready": len(self._ready),
            "pending": len(self._pending),
            "consumed": len(self._consumed),
            "waiting": len(self._waiters),
        }
