"""The staleness gate: DESIGN.md's admission and consumption rules as a pure object.

Admission is by prompt group: a new group may start only while
``accepted + in_flight < (v + η + 1) · B``. Consumption for step ``v → v+1`` must include
every accepted group whose version is ``≤ v − η``. Nothing here touches queues, engines or
clocks; the controller asks, and counts what it did.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessGate:
    """``η`` (``max_staleness``) and ``B`` (``groups_per_step``) of one run."""

    groups_per_step: int
    max_staleness: int

    def __post_init__(self) -> None:
        if self.groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def capacity(self, version: int, accepted: int, in_flight: int) -> int:
        """How many more groups may be admitted now.

        ``accepted`` counts groups written to the queue and not discarded (trained ones
        included); ``in_flight`` counts groups still generating. Discarded or aborted groups
        are in neither, so they return their credit.
        """
        limit = (version + self.max_staleness + 1) * self.groups_per_step
        return max(0, limit - accepted - in_flight)

    def must_include(self, group_version: int, version: int) -> bool:
        """Whether step ``version → version + 1`` must train a group of ``group_version``."""
        return group_version <= version - self.max_staleness

    def staleness(self, group_version: int, version: int) -> int:
        """How many versions behind the policy being trained a group is."""
        return version - group_version
