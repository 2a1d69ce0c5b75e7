"""``rollout.forced_lag``: the trainer held exactly η steps behind generation, and the realised
staleness recorded per group and per sample.

The fake engine generates a limited number of groups at once, so groups queued behind others
start on newer weights than they were admitted with: without forced lag they are trained less
stale than η; with it, every step once warm trains exactly the groups of version ``v − η``.
"""

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fakes import FakePipeline
from sluice.controller.loop import Controller
from sluice.controller.push import PushAdmission
from sluice.schedule.ledger import GroupLedger
from sluice.schedule.staleness import StalenessGate


def _run(eta, forced_lag, groups_per_step=4, steps=10, slots=4):
    pipe = FakePipeline(lambda gid: 0.002 + 0.001 * (gid % 3), slots=slots)
    ledger = GroupLedger(StalenessGate(groups_per_step, eta, forced_lag))
    controller = Controller(pipe, PushAdmission(pipe, ledger, groups_per_step))

    async def after_step(version, chosen, metrics):
        return True

    asyncio.run(asyncio.wait_for(controller.run(steps, after_step), timeout=60))
    return pipe, ledger


@pytest.mark.parametrize("eta", [1, 2, 4])
def test_forced_lag_trains_exactly_the_groups_of_version_v_minus_eta(eta):
    pipe, ledger = _run(eta, forced_lag=True)
    for step, gids in enumerate(pipe.steps):
        assert len(gids) == 4
        for gid in gids:
            assert step - ledger.groups[gid].version == min(step, eta), (step, gid)
    steps = len(pipe.steps)
    assert ledger.staleness == {**{k: 4 for k in range(eta)}, eta: 4 * (steps - eta)}
    assert ledger.sample_staleness == {k: 2 * v for k, v in ledger.staleness.items()}


@pytest.mark.parametrize("eta", [2, 4])
def test_without_forced_lag_queued_groups_are_trained_fresher_than_eta(eta):
    """The same engine without the mechanism: the histogram spreads below η (never above)."""
    pipe, ledger = _run(eta, forced_lag=False)
    warm = [step - ledger.groups[g].version for step, gids in enumerate(pipe.steps) if step >= eta for g in gids]
    assert max(warm) <= eta
    assert min(warm) < eta


def test_per_sample_staleness_counts_each_samples_oldest_token():
    ledger = GroupLedger(StalenessGate(1, 2))
    ledger.admitted(0, 0)
    ledger.finished(0, 0, 3, sample_versions=(0, 1, 1))  # interrupted: two samples resumed on v1
    ledger.choose(0)
    ledger.trained([0], 2)
    assert ledger.staleness == {2: 1}
    assert ledger.sample_staleness == {2: 1, 1: 2}


@given(
    eta=st.integers(0, 8),
    version=st.integers(0, 50),
    oldest=st.none() | st.integers(0, 50),
)
def test_gate_holds_syncs_only_with_forced_lag_and_older_groups_generating(eta, version, oldest):
    free = StalenessGate(4, eta)
    forced = StalenessGate(4, eta, forced_lag=True)
    assert free.may_sync(oldest, version)
    assert forced.may_sync(oldest, version) == (oldest is None or oldest >= version)
