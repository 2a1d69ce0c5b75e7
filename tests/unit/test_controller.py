"""The asynchronous controller and the staleness gate, driven by a fake pipeline with random
latencies; every check reads the consumed ledger (which group each step trained, and how each
group ended)."""

import asyncio
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fakes import FakePipeline
from sluice.controller.loop import Controller
from sluice.controller.push import PushAdmission
from sluice.schedule.ledger import GroupLedger, GroupState
from sluice.schedule.staleness import StalenessGate


def _run(pipeline, eta, groups_per_step=4, steps=8, redundant=0):
    ledger = GroupLedger(StalenessGate(groups_per_step, eta), redundant_groups=redundant)
    controller = Controller(pipeline, PushAdmission(pipeline, ledger, groups_per_step))

    async def after_step(version, chosen, metrics):
        return True

    asyncio.run(asyncio.wait_for(controller.run(steps, after_step), timeout=60))
    return controller, ledger


def _long_tailed(seed):
    rng = random.Random(seed)
    cache = {}

    def latency(gid):
        if gid not in cache:
            cache[gid] = 0.02 if rng.random() < 0.15 else rng.uniform(0.0, 0.004)
        return cache[gid]

    return latency


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_trained_group_is_older_than_eta_and_fates_add_up(eta, seed):
    pipe = FakePipeline(_long_tailed(seed))
    _, ledger = _run(pipe, eta)
    trained = [gid for step in pipe.steps for gid in step]
    assert len(trained) == len(set(trained)) == 8 * 4  # each trained exactly once, B per step
    for step, gids in enumerate(pipe.steps):
        for gid in gids:
            record = ledger.groups[gid]
            assert record.trained_at == step
            assert 0 <= step - record.version <= eta, (gid, step, record.version)
    states = {g.state for g in ledger.groups.values()}
    assert states <= {GroupState.TRAINED, GroupState.DISCARDED}
    assert sum(ledger.staleness.values()) == 32
    assert max(ledger.staleness) <= eta
    if eta == 0:  # synchronous: step v trains exactly the groups admitted for it, in order
        assert pipe.steps == [list(range(4 * v, 4 * v + 4)) for v in range(8)]


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_a_straggler_longer_than_eta_plus_one_steps_is_trained_not_starved(eta):
    slow = 1  # group 1 takes far longer than several steps' worth of the others

    pipe = FakePipeline(lambda gid: 0.15 if gid == slow else 0.001)
    _, ledger = _run(pipe, eta, steps=6)
    step_of = {gid: step for step, gids in enumerate(pipe.steps) for gid in gids}
    assert slow in step_of, "the long group was never trained"
    assert step_of[slow] - ledger.groups[slow].version <= eta
    assert step_of[slow] == eta  # admitted at version 0, must be included by step η at the latest
    assert ledger.stale_waits >= 1
    assert ledger.regenerated.total() == 0


def test_half_the_groups_discarded_returns_credit_and_finishes():
    rng = random.Random(5)
    dropped = {gid for gid in range(1000) if rng.random() < 0.5}
    pipe = FakePipeline(lambda gid: 0.001 * (gid % 3), discard=lambda gid: gid in dropped)
    _, ledger = _run(pipe, eta=1, steps=10)
    trained = [gid for step in pipe.steps for gid in step]
    assert len(trained) == 40 and not set(trained) & dropped
    by_filter = [g for g in ledger.groups.values() if g.discard_reason == "scripted"]
    assert {g.group_id for g in by_filter} <= dropped
    assert len(by_filter) >= 20  # half of ~40+ admitted groups: credit came back each time
    assert ledger.discards["scripted"] == 2 * len(by_filter)
    ends = {g.group_id for g in ledger.groups.values() if g.discard_reason == "run_end"}
    assert {g.group_id for g in ledger.groups.values() if g.group_id in dropped} == {g.group_id for g in by_filter} | (
        ends & dropped
    )


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_redundant_groups_replace_filtered_ones_and_surplus_is_aborted_with_credit(eta):
    rng = random.Random(eta)
    dropped = {gid for gid in range(1000) if rng.random() < 0.3}
    latency = _long_tailed(eta + 10)
    pipe = FakePipeline(latency, discard=lambda gid: gid in dropped)
    _, ledger = _run(pipe, eta, steps=8, redundant=3)
    trained = [gid for step in pipe.steps for gid in step]
    assert len(trained) == len(set(trained)) == 32 and not set(trained) & dropped
    for step, gids in enumerate(pipe.steps):
        assert all(0 <= step - ledger.groups[gid].version <= eta for gid in gids)
    redundant = {g.group_id for g in ledger.groups.values() if g.discard_reason == "redundant"}
    assert pipe.aborted and set(pipe.aborted) <= redundant  # every surplus group was stopped
    assert ledger.discards["redundant_groups"] == len(pipe.aborted)
    reported = [g for g in redundant if ledger.groups[g].generated or g not in pipe.aborted]
    assert ledger.discards["redundant"] == 2 * len(reported)  # their samples, counted once
    assert not redundant & set(trained) and max(ledger.staleness) <= eta


def test_redundant_admission_is_bounded_by_quota_plus_extra():
    ledger = GroupLedger(StalenessGate(4, 0), redundant_groups=2)
    assert ledger.capacity(0) == 6
    for gid in range(6):
        ledger.admitted(gid, 0)
    assert ledger.capacity(0) == 0
    ledger.discarded(0, "zero_signal", 2)  # a filtered group's credit returns
    assert ledger.capacity(0) == 1
    for gid in (1, 2, 3):
        ledger.finished(gid, 0, 2)
    assert ledger.abort_surplus("redundant") == []
    ledger.finished(4, 0, 2)  # quota of 4 accepted met: group 5 is surplus
    assert ledger.abort_surplus("redundant") == [5] and ledger.capacity(0) == 0
    assert ledger.late_report(5, 2) and ledger.discards["redundant"] == 2
    assert not ledger.late_report(4, 2)


@given(
    st.integers(1, 8),
    st.integers(0, 4),
    st.integers(0, 20),
    st.integers(0, 200),
    st.integers(0, 200),
)
def test_gate_capacity_is_the_admission_rule(batch, eta, version, accepted, in_flight):
    gate = StalenessGate(batch, eta)
    cap = gate.capacity(version, accepted, in_flight)
    assert cap == max(0, (version + eta + 1) * batch - accepted - in_flight)
    assert accepted + in_flight + cap <= max((version + eta + 1) * batch, accepted + in_flight)


@given(st.integers(0, 4), st.integers(0, 30), st.integers(0, 30))
def test_gate_must_include_exactly_the_groups_eta_behind(eta, group_version, version):
    gate = StalenessGate(4, eta)
    assert gate.must_include(group_version, version) == (version - group_version >= eta)


def test_gate_rejects_bad_parameters():
    with pytest.raises(ValueError, match="groups_per_step"):
        StalenessGate(0, 1)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(4, -1)


@pytest.mark.parametrize("eta", [1, 4])
def test_admission_stops_at_the_runs_budget(eta):
    """No group is admitted that no remaining step could train: a run without discards admits
    exactly steps · B groups, so none is generated only to be abandoned at the end."""
    pipe = FakePipeline(_long_tailed(eta))
    _, ledger = _run(pipe, eta, steps=5)
    assert len(ledger.groups) == 5 * 4
    assert not [g for g in ledger.groups.values() if g.discard_reason == "run_end"]
    assert sum(len(step) for step in pipe.steps) == 5 * 4


class _CheckedPipeline(FakePipeline):
    """Publishes each version's checksum; its engines load version ``wrong`` with other weights."""

    def __init__(self, wrong: int | None) -> None:
        super().__init__(lambda gid: 0.0)
        self.wrong = wrong

    async def finish_step(self) -> dict[str, float]:
        return {**await super().finish_step(), "weights_checksum": float(self.trainer_version)}

    async def sync_weights(self, version: int) -> dict[str, float]:
        await super().sync_weights(version)
        return {"engine_checksum": float(version) + (0.5 if version == self.wrong else 0.0)}


@pytest.mark.parametrize("eta", [0, 1])
def test_check_weights_stops_the_run_at_the_first_version_the_engines_hold_differently(eta):
    controller, _ = _run(_CheckedPipeline(wrong=None), eta, steps=4)
    assert controller.sync_metrics["weights_checked_version"] == 4.0
    with pytest.raises(RuntimeError, match=r"after loading version 3 the engines hold weights with checksum 3\.5"):
        _run(_CheckedPipeline(wrong=3), eta, steps=4)
