"""The multi-controller run's admission gate: credits per step slot under η, refills, fates."""

import random

import pytest

from sluice.api import GroupReport
from sluice.schedule.failures import FailureBudget, RunStopped
from sluice.schedule.staleness import StalenessGate
from sluice.schedule.step_gate import StepGate


def _gate(b=4, eta=1, steps=6, budget=1.0):
    return StepGate(StalenessGate(b, eta), steps, FailureBudget(budget, 4))


def _report(credit, reason=None, failed_by=None, size=2):
    return GroupReport(
        credit.group_id, credit.version, size, 10, (1.0,) * size, discard_reason=reason, failed_by=failed_by,
        sample_versions=(credit.version,) * size,
    )  # fmt: skip


def test_credits_stop_at_the_staleness_bound_and_open_with_each_version():
    gate = _gate(b=4, eta=1)
    first = gate.acquire(100, timeout=0)
    assert [c.step for c in first] == [0] * 4 + [1] * 4  # steps 0 .. v + η, nothing past them
    assert gate.acquire(1, timeout=0) == []
    assert {c.version for c in first} == {0}
    gate.advance(1)  # the engines hold v1: step 2's slots open
    assert [c.step for c in gate.acquire(100, timeout=0)] == [2] * 4


def test_sync_gate_grants_the_next_step_only_after_the_engines_load_it():
    gate = _gate(b=2, eta=0)
    credits = gate.acquire(10, timeout=0)
    assert [c.step for c in credits] == [0, 0]
    for c in credits:
        gate.report(_report(c))
    assert gate.acquire(1, timeout=0) == []  # trained or not, v is still 0
    assert [r.group_id for r in gate.step_reports(0)] == [c.group_id for c in credits]
    gate.advance(1)
    assert [c.step for c in gate.acquire(10, timeout=0)] == [1, 1]


def test_a_discarded_group_gives_its_slot_to_a_new_group_of_the_same_step():
    gate = _gate(b=2, eta=0)
    a, b = gate.acquire(2, timeout=0)
    gate.report(_report(a, reason="filter_groups"))
    (again,) = gate.acquire(5, timeout=0)
    assert again.step == 0 and again.group_id not in (a.group_id, b.group_id)
    gate.report(_report(b))
    gate.report(_report(again))
    assert [r.group_id for r in gate.step_reports(0)] == [b.group_id, again.group_id]
    counters = gate.books().counters()
    assert counters["groups_trained"] == 2 and counters["groups_discarded"] == 1
    assert counters["discarded_filter_groups"] == 2  # samples


def test_random_schedules_keep_every_group_within_eta_and_every_step_whole():
    rng = random.Random(0)
    for eta in (0, 1, 2):
        gate, pending, version = _gate(b=3, eta=eta, steps=8), [], 0
        while version < 8:
            pending += gate.acquire(rng.randint(1, 4), timeout=0)
            rng.shuffle(pending)
            for credit in pending[: rng.randint(0, len(pending))]:
                assert credit.step <= credit.version + eta  # the bound, at admission
                gate.report(_report(credit, reason="filter_groups" if rng.random() < 0.3 else None))
                pending.remove(credit)
            if len(gate.filled.get(version, [])) == 3:
                reports = gate.step_reports(version)
                assert all(version - r.version <= eta for r in reports)  # and when trained
                version += 1
                gate.advance(version)
        books = gate.books()
        assert books.counters()["groups_trained"] == 24
        assert max(books.staleness) <= eta


def test_close_wakes_waiting_workers_and_books_the_unreported_as_run_end():
    gate = _gate(b=2, eta=0)
    credits = gate.acquire(2, timeout=0)
    gate.close()
    assert gate.acquire(1, timeout=5) == []  # returns at once, closed
    books = gate.books()
    assert books.counters()["groups_discarded"] == 2 and "run_end" in books.discards
    gate.report(_report(credits[0]))  # a late report of an aborted group changes nothing
    assert books.counters()["groups_discarded"] == 2


def test_a_reward_over_the_failure_budget_stops_admission():
    gate = _gate(b=4, eta=0, budget=0.25)
    credits = gate.acquire(4, timeout=0)
    with pytest.raises(RunStopped):
        for c in credits:
            gate.report(_report(c, reason="reward_failed", failed_by="reward 'broken'"))
    assert gate.acquire(1, timeout=1) == []


def test_a_trained_step_waits_for_its_last_reports():
    """Rows reach the queue before their group's report reaches the gate: the trainer may finish a
    step first, and the step's books wait for the report instead of failing."""
    import threading

    gate = _gate(b=2, eta=0)
    a, b = gate.acquire(2, timeout=0)
    gate.report(_report(a))
    late = threading.Timer(0.2, gate.report, args=(_report(b),))
    late.start()
    assert [r.group_id for r in gate.step_reports(0, timeout=30)] == [a.group_id, b.group_id]
    with pytest.raises(RuntimeError, match="step 1 trained with 0 groups"):
        gate.step_reports(1, timeout=0)
