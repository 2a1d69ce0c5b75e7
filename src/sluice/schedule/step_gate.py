"""Admission of a multi-controller run (``run.controller: multi``): credits for steps' slots.

Every rollout worker asks ``acquire(n)`` for up to ``n`` credits: a fresh group id, the step
(global batch, queue partition) the group fills a slot of, and the version the engines hold. A
slot of step ``s`` is granted only while ``s ≤ v + η`` (``v``: the version every engine holds,
which the driver sets with ``advance`` after each weight sync), and slots are granted in step
order, so the credits follow ``StalenessGate``'s rule ``accepted + in_flight < (v + η + 1) · B``
and no group trains more than η versions stale. A reported group either fills its slot or —
discarded by a named filter or a failing reward — gives the slot back to the next ``acquire``
(a replacement with a new id and the next prompt). The books are the run's ``GroupLedger``,
kept here and handed to the driver at the end; ``step_reports`` hands the driver a trained
step's reports (rewards, lengths, versions: never sample data). One instance runs as a
threaded Ray actor; the object itself is plain and tested in-process. It moves no rows.
"""

from __future__ import annotations

import copy
import threading
from collections import defaultdict
from dataclasses import dataclass

from sluice.api import Credit, GroupReport
from sluice.schedule.failures import FailureBudget, RunStopped
from sluice.schedule.ledger import GroupLedger
from sluice.schedule.staleness import StalenessGate


@dataclass
class GateCut:
    """The gate's books at a step boundary (a checkpoint's): deep copies."""

    ledger: GroupLedger
    next_group: int
    trained_steps: int
    filled: dict[int, list[GroupReport]]
    """Per untrained step, the reports of the groups written into it."""
    pending: dict[int, int]
    """Groups granted and still generating, by id: their step."""


class StepGate:
    def __init__(self, gate: StalenessGate, steps: int, failures: FailureBudget) -> None:
        self.failures = failures
        """Judges every reported group: over budget, ``report`` raises ``RunStopped`` (the reporting
        worker's loop ends with it, and the driver's run with its one line) and no credit follows."""
        self.gate = gate
        self.ledger = GroupLedger(gate)
        self.groups_per_step, self.steps = gate.groups_per_step, steps
        self.version = 0
        """The version every engine holds (the driver's ``advance``)."""
        self.next_group = 0
        self.filled: defaultdict[int, list[GroupReport]] = defaultdict(list)
        """Per step, the reports of the groups that filled its slots."""
        self.pending: defaultdict[int, int] = defaultdict(int)
        """Per step, slots granted and not yet reported."""
        self.step_of: dict[int, int] = {}
        self.trained_steps = 0
        self.closed = False
        self._cond = threading.Condition()

    def _open_step(self) -> int | None:
        """The lowest step with a free slot that the staleness bound lets start now."""
        for step in range(self.trained_steps, self.steps):
            used = len(self.filled[step]) + self.pending[step]
            if used < self.groups_per_step:
                return step if self.gate.may_open(step, used, self.version) else None
        return None

    def acquire(self, n: int, timeout: float | None = None) -> list[Credit]:
        """Up to ``n`` credits, waiting until at least one slot is free; empty once the gate is
        closed (or on timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self.closed or self._open_step() is not None, timeout)
            credits: list[Credit] = []
            while not self.closed and len(credits) < n and (step := self._open_step()) is not None:
                gid, self.next_group = self.next_group, self.next_group + 1
                self.ledger.admitted(gid, self.version)
                self.pending[step] += 1
                self.step_of[gid] = step
                credits.append(Credit(gid, step, self.version))
            return credits

    def report(self, report: GroupReport) -> None:
        """A group ended: it fills its slot, or (discarded) frees it for a replacement."""
        with self._cond:
            step = self.step_of.pop(report.group_id, None)
            if step is None:  # after ``books``: already counted as discarded at the run's end
                return
            self.pending[step] -= 1
            if report.discard_reason is None:
                self.ledger.finished(report.group_id, report.version, report.num_samples, report.sample_versions)
                self.filled[step].append(report)
            else:
                self.ledger.discarded(report.group_id, report.discard_reason, report.num_samples)
            self._cond.notify_all()
            try:
                self.failures.record(report)
            except RunStopped:
                self.closed = True
                raise

    def step_reports(self, step: int, timeout: float | None = None) -> list[GroupReport]:
        """Step ``step`` was trained: its groups' reports (in group order), booked as trained. A
        group's rows reach the queue before its report reaches the gate, so this waits for the
        last reports (up to ``timeout``)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.filled.get(step, ())) >= self.groups_per_step, timeout)
            reports = sorted(self.filled.pop(step, []), key=lambda r: r.group_id)
            if len(reports) != self.groups_per_step:
                raise RuntimeError(f"step {step} trained with {len(reports)} groups, expected {self.groups_per_step}")
            chosen = [r.group_id for r in reports]
            for gid in chosen:
                self.ledger.choose(gid)
            self.ledger.trained(chosen, step)
            self.trained_steps = step + 1
            return reports

    def advance(self, version: int) -> None:
        """Every engine holds ``version``: slots up to ``version + η`` open."""
        with self._cond:
            self.version = max(self.version, version)
            self._cond.notify_all()

    def close(self) -> None:
        """No more credits: every waiting ``acquire`` returns empty."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def books(self, reason: str = "run_end") -> GroupLedger:
        """The run's books; groups granted and still unreported are discarded as ``reason``."""
        with self._cond:
            for gid in list(self.step_of):
                self.ledger.discarded(gid, reason, 0)
            self.step_of.clear()
            return self.ledger

    def cut(self) -> GateCut:
        with self._cond:
            filled = {step: list(reports) for step, reports in self.filled.items() if reports}
            books = copy.deepcopy(self.ledger)
            return GateCut(books, self.next_group, self.trained_steps, filled, dict(self.step_of))

    def restore(self, cut: GateCut, version: int) -> None:
        """Continue from ``cut`` with the engines at ``version``: its generating groups stay
        granted, for the workers to generate again (counted ``regenerated_restart_groups``)."""
        with self._cond:
            self.ledger, self.next_group = copy.deepcopy(cut.ledger), cut.next_group
            self.trained_steps = cut.trained_steps
            self.filled = defaultdict(list, {step: list(r) for step, r in cut.filled.items()})
            self.step_of = dict(cut.pending)
            self.pending = defaultdict(int)
            for step in cut.pending.values():
                self.pending[step] += 1
            self.ledger.regenerated["restart_groups"] += len(cut.pending)
            self.version = version
            self._cond.notify_all()

    def counters(self) -> dict[str, float]:
        with self._cond:
            return {"version": float(self.version), "granted": float(self.next_group), **self.ledger.counters()}
