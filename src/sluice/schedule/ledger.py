"""The group ledger: where every admitted prompt group is, and how each one ended.

It is the controller's bookkeeping for DESIGN.md's rules: ``accepted`` / ``in_flight`` for
admission, per-group versions for consumption (oldest first, must-include ``≤ v − η``), and the
fates of samples — trained (with its staleness), discarded (per named reason) or regenerated —
as counters and as a consumed ledger that tests audit. It moves no sample data and starts no
work. Every group's record stays in ``groups``, but the per-report questions (admission credit,
the next group for a step, surplus) read only the live groups (open or chosen) and the sorted
versions of the trained ones, so their cost does not grow with the run's length.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from sluice.schedule.staleness import StalenessGate


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
    discard_reason: str | None = None
    sample_versions: tuple[int, ...] = ()
    """Each sample's oldest token's version (empty: all samples have the group's ``version``)."""


@dataclass
class GroupLedger:
    """Mutable state of all groups of one run; single-threaded (the controller's event loop)."""

    gate: StalenessGate
    groups: dict[int, GroupRecord] = field(default_factory=dict)
    discards: Counter[str] = field(default_factory=Counter)
    regenerated: Counter[str] = field(default_factory=Counter)
    staleness: Counter[int] = field(default_factory=Counter)
    """Histogram of realised staleness (versions) over trained groups."""
    sample_staleness: Counter[int] = field(default_factory=Counter)
    """Histogram of realised staleness over trained samples (each sample's oldest token; a group's
    samples may differ when generation was interrupted by a weight update)."""
    stale_waits: int = 0
    """Must-include groups a step had to wait for because they were still generating."""
    redundant_groups: int = 0
    """Extra groups admission may keep generating beyond the gate (redundant prompts, ROLL
    Flash): they replace filtered groups at once; once the gate's quota of accepted groups is met
    the surplus still generating is aborted (``abort_surplus``)."""
    _waited: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        """The indexes, derived from ``groups`` (a decoded checkpoint's ledger rebuilds them)."""
        live = (GroupState.OPEN, GroupState.CHOSEN)
        self._live: dict[int, GroupRecord] = {gid: g for gid, g in self.groups.items() if g.state in live}
        """Groups neither trained nor discarded: all that admission and the steps still ask about."""
        self._trained_versions: list[int] = sorted(
            g.version for g in self.groups.values() if g.state is GroupState.TRAINED
        )

    @property
    def in_flight(self) -> int:
        """Groups still generating."""
        return sum(not g.generated for g in self._live.values())

    @property
    def accepted(self) -> int:
        """Groups written to the queue and not discarded (trained ones included)."""
        return len(self._trained_versions) + sum(g.generated for g in self._live.values())

    def capacity(self, version: int) -> int:
        """Groups admission may start now at engine ``version``: the gate's credit, plus up to
        ``redundant_groups`` more in flight while the quota ``(v + η + 1) · B`` is not yet met."""
        accepted, in_flight = self.accepted, self.in_flight
        credit = self.gate.capacity(version, accepted, in_flight)
        quota = self._quota(version)
        if not self.redundant_groups or accepted >= quota:
            return credit
        return max(credit, quota + self.redundant_groups - accepted - in_flight)

    def abort_surplus(self, reason: str) -> list[int]:
        """Groups still generating that can no longer be trained within the staleness bound:
        a group of version ``a`` once ``(a + η + 1) · B`` groups of version ``≤ a`` are accepted
        (only redundant admission can leave such groups). Each is discarded as ``reason`` now
        (its credit returns at once); returns the ids to stop."""
        surplus = [
            g
            for g in self._live.values()
            if not g.generated
            and g.state is GroupState.OPEN
            and self._accepted_at_most(g.version) >= self._quota(g.version)
        ]
        for g in surplus:
            g.state, g.discard_reason = GroupState.DISCARDED, reason
            del self._live[g.group_id]
            self.discards[f"{reason}_groups"] += 1
        return [g.group_id for g in surplus]

    def fits(self, version: int) -> bool:
        """Whether one more accepted group of ``version`` keeps every bound ``#(accepted of
        version ≤ c) ≤ (c + η + 1) · B``. Always true without redundant groups (admission
        guarantees it); with them, a group that finished on newer weights than it was admitted
        with may not fit, and is then discarded as surplus."""
        if not self.redundant_groups:
            return True
        later = set(self._trained_versions[bisect.bisect_left(self._trained_versions, version) :])
        later |= {g.version for g in self._live.values() if g.generated and g.version >= version} | {version}
        return all(self._accepted_at_most(c) + 1 <= self._quota(c) for c in later)

    def late_report(self, group_id: int, num_samples: int) -> bool:
        """A report for a group already discarded by ``abort_surplus`` (it was stopped, or finished
        first): count its samples under that reason. False if the group is not such a group."""
        g = self.groups.get(group_id)
        if g is None or g.state is not GroupState.DISCARDED or g.generated:
            return False
        g.generated, g.num_samples = True, num_samples
        self.discards[g.discard_reason or "unknown"] += num_samples
        return True

    def _accepted_at_most(self, version: int) -> int:
        """Accepted groups (trained ones included) of version ``≤ version``."""
        live = sum(g.generated and g.version <= version for g in self._live.values())
        return bisect.bisect_right(self._trained_versions, version) + live

    def _quota(self, version: int) -> int:
        return self.gate.quota(version)

    def admitted(self, group_id: int, version: int) -> None:
        if group_id in self.groups:
            raise ValueError(f"group {group_id} admitted twice")
        self.groups[group_id] = self._live[group_id] = GroupRecord(group_id, version)

    def finished(self, group_id: int, version: int, num_samples: int, sample_versions: tuple[int, ...] = ()) -> None:
        """The group's rows are in the queue; ``version`` is its oldest token's."""
        g = self._generating(group_id)
        g.version, g.num_samples, g.generated = version, num_samples, True
        g.sample_versions = sample_versions

    def oldest_generating(self) -> int | None:
        """The admission version of the oldest group still generating (``None``: none is)."""
        versions = [g.version for g in self._live.values() if not g.generated]
        return min(versions, default=None)

    def discarded(self, group_id: int, reason: str, num_samples: int) -> None:
        """A group dropped by a named filter; its credit returns (it leaves ``accepted``/``in_flight``)."""
        g = self._generating(group_id)
        if g.state is not GroupState.OPEN:
            raise ValueError(f"group {group_id} was already taken by a step; it cannot be discarded")
        g.state, g.num_samples, g.discard_reason = GroupState.DISCARDED, num_samples, reason
        del self._live[group_id]
        self.discards[reason] += num_samples

    def next_for_step(self, version: int, chosen: int, engine_version: int) -> int | None:
        """The next generated group step ``version`` should take (``chosen`` taken so far), or
        ``None`` to wait for news.

        Must-include groups (version ``≤ v − η``) come first, in (version, id) order, waiting
        for each still generating — at η = 0 that is exactly the sync loop's order. Then the
        oldest ready group, but only if taking it leaves enough slots in the coming steps for
        every group that must be trained by then (a group of version ``g`` by step ``g + η``),
        counting groups still generating and, while the engines are behind, those admission may
        still add; otherwise the step waits for the old groups still generating.
        ``stale_waits`` counts each group waited on once.
        """
        open_groups = sorted(
            (g for g in self._live.values() if g.state is GroupState.OPEN), key=lambda g: (g.version, g.group_id)
        )
        must = next((g for g in open_groups if self.gate.must_include(g.version, version)), None)
        if must is not None and must.generated:
            return must.group_id
        ready = next((g for g in open_groups if g.generated), None)
        if must is None and ready is not None and self._feasible(ready, version, chosen, engine_version, open_groups):
            return ready.group_id
        blocking = must or next((g for g in open_groups if not g.generated), None)
        if blocking is not None and blocking.group_id not in self._waited:
            self._waited.add(blocking.group_id)
            self.stale_waits += 1
        return None

    def _feasible(
        self, take: GroupRecord, version: int, chosen: int, engine_version: int, open_groups: list[GroupRecord]
    ) -> bool:
        """After taking ``take``, can every deadline ``d`` in ``(v, v + η)`` still be met?

        (Deadline ``v`` is the must-include rule; ``v + η`` and later always fit, by the
        admission bound.)"""
        per_step = self.gate.groups_per_step
        for deadline, newest in self.gate.deadlines(version):  # versions <= newest: trained by `deadline`
            due = sum(1 for g in open_groups if g.version <= newest and g is not take)
            if engine_version <= newest:  # admission can still add groups of that version
                due += self.capacity(engine_version)
            slots = (deadline - version + 1) * per_step - chosen - 1
            if due > slots:
                return False
        return True

    def choose(self, group_id: int) -> None:
        self._expect(group_id, GroupState.OPEN).state = GroupState.CHOSEN

    def trained(self, group_ids: list[int], version: int) -> None:
        """Step ``version → version + 1`` consumed ``group_ids`` (each exactly once)."""
        for gid in group_ids:
            g = self._expect(gid, GroupState.CHOSEN)
            g.state, g.trained_at = GroupState.TRAINED, version
            del self._live[gid]
            bisect.insort(self._trained_versions, g.version)
            self.staleness[self.gate.staleness(g.version, version)] += 1
            for sample_version in g.sample_versions or (g.version,) * g.num_samples:
                self.sample_staleness[self.gate.staleness(sample_version, version)] += 1

    def abandon_open(self, reason: str) -> int:
        """End of run: every group not trained (generating or ready) is discarded as ``reason``."""
        count = 0
        for g in [g for g in self._live.values() if g.state is GroupState.OPEN]:
            del self._live[g.group_id]
            g.state, g.discard_reason = GroupState.DISCARDED, reason
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
