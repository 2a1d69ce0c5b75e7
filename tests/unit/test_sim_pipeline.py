"""SimPipeline under the real Controller on the virtual clock: the staleness bound holds
with redundant groups and each weight mode; staggered updates never stall every replica."""

from __future__ import annotations

import pytest

from sluice.controller.loop import Controller
from sluice.controller.push import PushAdmission
from sluice.rollout.filters import zero_signal
from sluice.schedule.ledger import GroupLedger
from sluice.schedule.staleness import StalenessGate
from sluice.sim import LengthModel, SimEngine, SimEngineConfig, run_virtual
from sluice.sim.pipeline import SimPipeline, SimTrainerConfig, stalled_together_s
from sluice.sim.task import SimReward, sim_prompts

ENGINE = SimEngineConfig(decode_s=0.01, knee=8, max_running=16, load_s=1.0, lengths=LengthModel(40, 0.5, 1.0))


def _run(mode: str, redundant: int, eta: int = 1, steps: int = 6):
    engines = [SimEngine(ENGINE) for _ in range(3)]
    pipeline = SimPipeline(
        engines, sim_prompts(256, signal_fraction=0.6, prompt_len=8), group_size=4, max_new_tokens=1000,
        weight_update=mode, trainer=SimTrainerConfig(per_sample_s=0.02, step_s=0.5),  # type: ignore[arg-type]
        reward=SimReward(0.1), group_filter=zero_signal,
    )  # fmt: skip
    ledger = GroupLedger(StalenessGate(4, eta), redundant_groups=redundant)
    controller = Controller(pipeline, PushAdmission(pipeline, ledger, 4))

    async def after_step(version, chosen, metrics):
        return True

    run_virtual(controller.run(steps, after_step))
    return ledger, engines


@pytest.mark.parametrize("mode", ["interrupt", "defer", "staggered"])
def test_weight_modes_keep_the_bound_and_staggered_never_stalls_everyone(mode):
    ledger, engines = _run(mode, redundant=4)
    assert ledger.counters()["groups_trained"] == 24 and max(ledger.staleness) <= 1
    assert ledger.discards["zero_signal"] > 0 and ledger.discards["redundant_groups"] > 0
    assert all(e.stats()["version"] == 6 for e in engines)
    stalled = stalled_together_s(engines)
    if mode == "staggered":
        assert stalled == 0.0
    else:  # interrupt: all replicas load at once (1 s each step), defer also drains
        assert stalled >= 6 * ENGINE.load_s - 1e-9


def test_eta0_with_redundancy_trains_only_fresh_groups():
    ledger, _ = _run("interrupt", redundant=8, eta=0)
    assert set(ledger.staleness) == {0} and ledger.discards["redundant_groups"] > 0
