"""Push admission (the driver's waves over ``GroupLedger``) and pull admission (credits from
``StepGate``, the multi-controller's) follow the one rule of ``StalenessGate``: driven by the same
random schedules at every η in 0–3 (fractional ones too), they admit the same groups at every
moment, and, when groups finish in admission order, train the same groups at every step."""

import math
import random

import pytest

from sluice.api import GroupReport
from sluice.schedule.failures import FailureBudget
from sluice.schedule.ledger import GroupLedger
from sluice.schedule.staleness import StalenessGate
from sluice.schedule.step_gate import StepGate


def _report(group_id: int, version: int, reason: str | None) -> GroupReport:
    return GroupReport(group_id, version, 1, 4, (1.0,), discard_reason=reason, sample_versions=(version,))


def _push_step(ledger: GroupLedger, version: int, per_step: int) -> list[int]:
    """The driver's choice for step ``version`` (enough groups are ready)."""
    chosen: list[int] = []
    while len(chosen) < per_step:
        gid = ledger.next_for_step(version, len(chosen), engine_version=version)
        assert gid is not None, f"step {version}: the ledger chose only {chosen}"
        ledger.choose(gid)
        chosen.append(gid)
    return chosen


def _run(eta: float, seed: int, discard: float) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """One random schedule through both admissions. Returns the groups each admitted at each
    moment (push, pull: compared by the caller) and the groups each step trained (push, pull)."""
    rng = random.Random(seed)
    per_step, steps = rng.randint(1, 4), rng.randint(2, 6)
    gate = StalenessGate(per_step, eta)
    push, pull = GroupLedger(gate), StepGate(gate, steps, FailureBudget(1.0, 4))
    version, next_id, generating = 0, 0, []
    trained_push: list[list[int]] = []
    trained_pull: list[list[int]] = []
    for _ in range(200):
        if version == steps:
            break
        # a run admits at most its steps' groups: the pull gate has no slots past the last step
        room = steps * per_step - push.accepted - push.in_flight
        wave = list(range(next_id, next_id + min(push.capacity(version), room)))
        ahead = push.accepted + push.in_flight + len(wave) - (version + 1) * per_step
        assert ahead <= math.floor(eta * per_step + 1e-9), f"η={eta} v{version}: {ahead} groups ahead of B={per_step}"
        for gid in wave:
            push.admitted(gid, version)
        credits = pull.acquire(10**6, timeout=0)
        assert [c.group_id for c in credits] == wave, f"η={eta} v{version}: push {wave}, pull {credits}"
        next_id += len(wave)
        generating += [(gid, version) for gid in wave]
        cut = rng.randint(0, len(generating))
        done, generating = generating[:cut], generating[cut:]
        for gid, admitted_at in done:  # in admission order
            reason = "filtered" if rng.random() < discard else None
            if reason is None:
                push.finished(gid, admitted_at, 1, (admitted_at,))
            else:
                push.discarded(gid, reason, 1)
            pull.report(_report(gid, admitted_at, reason))
        ready = sum(1 for g in push.groups.values() if g.generated and g.state.value == "open")
        if discard == 0.0:  # the same groups ready on both sides: a step is ready on both or neither
            assert (ready >= per_step) == (len(pull.filled.get(version, ())) == per_step)
        if ready < per_step or len(pull.filled.get(version, ())) < per_step:
            continue  # a discarded slot of the pull gate waits for its replacement
        chosen = _push_step(push, version, per_step)
        push.trained(chosen, version)
        trained_push.append(sorted(chosen))
        trained_pull.append([r.group_id for r in pull.step_reports(version, timeout=0)])
        version += 1
        pull.advance(version)
    assert version == steps, "the schedule never finished its steps"
    books = pull.books()
    assert push.counters()["groups_trained"] == books.counters()["groups_trained"] == steps * per_step
    trained = [g for ledger in (push, books) for g in ledger.groups.values() if g.trained_at is not None]
    return trained_push, trained_pull, [[g.version for g in trained if g.trained_at == v] for v in range(steps)]


@pytest.mark.parametrize("eta", [0, 0.5, 1, 1.5, 2, 3])
def test_push_and_pull_admit_and_train_the_same_groups(eta: float) -> None:
    for seed in range(60):
        trained_push, trained_pull, versions = _run(eta, seed * 7 + int(eta * 2), discard=0.0)
        assert trained_push == trained_pull, f"η={eta} seed {seed}"
        assert all(step - v <= math.ceil(eta) for step, vs in enumerate(versions) for v in vs)


@pytest.mark.parametrize("eta", [0, 0.5, 1, 1.5, 2, 3])
def test_push_and_pull_admit_the_same_groups_when_filters_discard(eta: float) -> None:
    """Discarded groups return their credit on both sides at once (same admissions, compared
    inside ``_run``); each side trains every step full and no group past η. Which groups a step
    trains may differ: a pull credit names its step (its rows go to that step's partition), so a
    discarded slot waits for its replacement, while the driver takes the oldest ready group."""
    for seed in range(60):
        _, _, versions = _run(eta, 1000 + seed * 7 + int(eta * 2), discard=0.3)
        assert all(step - v <= math.ceil(eta) for step, vs in enumerate(versions) for v in vs)


def test_a_fractional_eta_admits_part_of_a_batch_ahead() -> None:
    """ROLL Flash's asynchrony ratio: at η = 0.5 and B = 4 two groups may run ahead of the next
    batch (quota ⌊(v + 1.5) · 4⌋), a pull credit opens slot by slot, and every group of version
    ``v − 1`` is due at step ``v`` (a trained group is at most ⌈η⌉ = 1 version old)."""
    gate = StalenessGate(4, 0.5)
    assert [gate.quota(v) for v in range(3)] == [6, 10, 14]
    assert gate.capacity(0, accepted=0, in_flight=5) == 1
    assert [gate.may_open(1, slot, 0) for slot in range(4)] == [True, True, False, False]
    assert gate.must_include(0, 1) and not gate.must_include(1, 1)
    assert gate.deadlines(3) == [] and StalenessGate(4, 1.5).deadlines(3) == [(4, 2)]
    assert StalenessGate(10, 0.1).quota(0) == 11  # 0.1 · 10 is one group, not 0.999…
    pull = StepGate(gate, 3, FailureBudget(1.0, 4))
    assert [c.step for c in pull.acquire(100, timeout=0)] == [0, 0, 0, 0, 1, 1]
