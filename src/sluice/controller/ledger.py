"""The group ledger: where every admitted prompt group is, and how each one ended.

It is the controller's bookkeeping for DESIGN.md's rules: ``accepted`` / ``in_flight`` for
admission, per-group versions for consumption (oldest first, must-include ``≤ v − η``), and the
fates of samples — trained (with its staleness), discarded (per named reason) or regenerated —
as counters and as a consumed ledger that tests audit. It moves no sample data and starts no
work.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from sluice.controller.staleness import StalenessGate


class GroupState(Enum):
    OPEN = "open"
    """Admitted, not yet taken by a training step."""
    CHOSEN = "chosen"
    """Taken by the current training step (possibly still generating: streaming)."""
    TRAINED = "trained"
    DISCARDED = "discarded"


@dataclass
class GroupRecord:
    group_id: int
    version: int
    """Admission-time engine version, replaced by the oldest token's version once generated."""
    state: GroupState = GroupState.OPEN
    generated: bool = False
    num_samples: int = 0
    trained_at: int | None = None


@dataclass
class GroupLedger:
    """Mutable state of all groups of one run; single-threaded (the controller's event loop)."""

    gate: StalenessGate
    groups: dict[int, GroupRecord] = field(default_factory=dict)
    discards: Counter[str] = field(default_factory=Counter)
    regenerated: Counter[str] = field(default_factory=Counter)
    staleness: Counter[int] = field(default_factory=Counter)
    """Histogram of realised staleness (versions) over trained groups."""
    stale_waits: int = 0
    """Must-include groups a step had to wait for because they were still generating."""
    _waited: set[int] = field(default_factory=set)

    @property
    def in_flight(self) -> int:
        """Groups still generating."""
        return sum(not g.generated and g.state is not GroupState.DISCARDED for g in self.groups.values())

    @property
    def accepted(self) -> int:
        """Groups written to the queue and not discarded (trained ones included)."""
        return sum(g.generated and g.state is not GroupState.DISCARDED for g in self.groups.values())

    def capacity(self, version: int) -> int:
        return self.gate.capacity(version, self.accepted, self.in_flight)

    def admitted(self, group_id: int, version: int) -> None:
        if group_id in self.groups:
            raise ValueError(f"group {group_id} admitted twice")
        self.groups[group_id] = GroupRecord(group_id, version)

    def finished(self, group_id: int, version: int, num_samples: int) -> None:
        """The group's rows are in the queue; ``version`` is its oldest token's."""
        g = self._generating(group_id)
        g.version, g.num_samples, g.generated = version, num_samples, True

    def discarded(self, group_id: int, reason: str, num_samples: int) -> None:
        """A group dropped by a named filter; its credit returns (it leaves ``accepted``/``in_flight``)."""
        g = self._generating(group_id)
        if g.state is not GroupState.OPEN:
            raise ValueError(f"group {group_id} was already taken by a step; it cannot be discarded")
        g.state, g.num_samples = GroupState.DISCARDED, num_samples
        self.discards[reason] += num_samples

    def next_for_step(self, version: int) -> int | None:
        """The next generated group step ``version`` should take, or ``None`` to wait for news.

        Must-include groups (``group version ≤ v − η``) come first, oldest first: while the
        oldest of them is still generating the step waits for it (counted once per group in
        ``stale_waits``) rather than taking a newer ready group. Otherwise the oldest ready group.
        """
        open_groups = sorted(
            (g for g in self.groups.values() if g.state is GroupState.OPEN), key=lambda g: (g.version, g.group_id)
        )
        for g in open_groups:
            if self.gate.must_include(g.version, version):
                if g.generated:
                    return g.group_id
                if g.group_id not in self._waited:
                    self._waited.add(g.group_id)
                    self.stale_waits += 1
                return None
        ready = [g for g in open_groups if g.generated]
        return ready[0].group_id if ready else None

    def choose(self, group_id: int) -> None:
        self._expect(group_id, GroupState.OPEN).state = GroupState.CHOSEN

    def trained(self, group_ids: list[int], version: int) -> None:
        """Step ``version → version + 1`` consumed ``group_ids`` (each exactly once)."""
        for gid in group_ids:
            g = self._expect(gid, GroupState.CHOSEN)
            g.state, g.trained_at = GroupState.TRAINED, version
            self.staleness[self.gate.staleness(g.version, version)] += 1

    def abandon_open(self, reason: str) -> int:
        """End of run: every group not trained (generating or ready) is discarded as ``reason``."""
        count = 0
        for g in self.groups.values():
            if g.state is GroupState.OPEN:
                g.state = GroupState.DISCARDED
                self.discards[reason] += g.num_samples if g.generated else 0
                self.discards[f"{reason}_groups"] += 1
                count += 1
        return count

    def counters(self) -> dict[str, float]:
        states = Counter(g.state.value for g in self.groups.values())
        out = {f"groups_{k}": float(v) for k, v in states.items()}
        out.update({f"discarded_{k}": float(v) for k, v in self.discards.items()})
        out.update({f"regenerated_{k}": float(v) for k, v in self.regenerated.items()})
        out["stale_waits"] = float(self.stale_waits)
        return out

    def _generating(self, group_id: int) -> GroupRecord:
        g = self.groups.get(group_id)
        if g is None or g.generated or g.state is GroupState.DISCARDED:
            raise ValueError(f"group {group_id} is not generating")
        return g

    def _expect(self, group_id: int, state: GroupState) -> GroupRecord:
        g = self.groups.get(group_id)
        if g is None or g.state is not state:
            have = "unknown" if g is None else g.state.value
            raise ValueError(f"group {group_id}: expected {state.value}, found {have}")
        return g
