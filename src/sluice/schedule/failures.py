"""The failure budget: a reward or environment that fails too many of the newest groups stops the run.

Every group a rollout reports is an outcome: a success (trained, or discarded by a filter), or a
failure of the reward or environment its report names (``GroupReport.failed_by``: a reward that
raised, timed out or returned a non-number, an environment that raised or timed out). Over the
last ``run.failure_window`` outcomes, once one reward's or environment's failures exceed
``run.failure_budget`` × window, ``FailureBudget.record`` raises ``FailureBudgetExceeded``: one
line naming it, the count and its last error, which the CLI prints without a traceback. So a
reward that always fails stops the run after ``budget × window`` groups instead of discarding and
replacing groups forever, and one that fails now and then only costs its groups.

It judges reports; it does not discard groups (the rollout does), count fates (the ledger does) or
stop workers (the controller does, on the error).
"""

from __future__ import annotations

from collections import Counter, deque

from sluice.api import GroupReport


class RunStopped(Exception):
    """The run stopped on purpose; the message is the one line that says why (``sluice train``
    prints it and exits 1)."""


class FailureBudgetExceeded(RunStopped):
    """A reward or environment failed more groups than ``run.failure_budget`` allows."""

    def __init__(self, failed_by: str, failures: int, groups: int, budget: float, error: str) -> None:
        share = f"{failures} of the last {groups} groups (budget {budget * 100:g} %)"
        super().__init__(f"{failed_by} failed {share}; last error: {error}")
        self.failed_by = failed_by
        self.failures = failures


class FailureBudget:
    """``record(report)`` for every finished group; raises once a failure source is over budget."""

    def __init__(self, budget: float, window: int) -> None:
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"run.failure_budget must be in (0, 1], got {budget}")
        if window < 1:
            raise ValueError(f"run.failure_window must be >= 1, got {window}")
        self.budget = budget
        self.window = window
        self._outcomes: deque[str | None] = deque()
        """The newest ``window`` outcomes: who failed the group, or ``None`` for a success."""
        self._failures: Counter[str] = Counter()
        """Failures per source inside the window."""
        self.last_error: dict[str, str] = {}

    def record(self, report: GroupReport) -> None:
        """Count one finished group; ``FailureBudgetExceeded`` when its failure source (if any) now
        has more than ``budget × window`` failures among the newest ``window`` groups."""
        if len(self._outcomes) == self.window:
            oldest = self._outcomes.popleft()
            if oldest is not None:
                self._failures[oldest] -= 1
        who = report.failed_by
        self._outcomes.append(who)
        if who is None:
            return
        self._failures[who] += 1
        failures = self._failures[who]
        self.last_error[who] = report.error or report.discard_reason or "unknown"
        if failures > self.budget * self.window:
            raise FailureBudgetExceeded(who, failures, len(self._outcomes), self.budget, self.last_error[who])
