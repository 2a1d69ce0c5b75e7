"""Pipeline simulator invariants: every admitted sample has one fate, staleness never exceeds
η, more replicas never make a step slower, and the timeline is a real-run-format trace."""

from __future__ import annotations

import itertools

import pytest

from sluice.sim.cost_model import TrainerCost
from sluice.sim.engine import LengthModel, SimEngineConfig
from sluice.sim.simulate import MODES, SimConfig, SimResult, simulate
from sluice.telemetry.trace import trace_summary


def trace_fractions(result: SimResult) -> dict:
    """The same headline numbers ``sluice trace`` reports for a real run, from the simulated trace."""
    summary = trace_summary(result.events)
    return {k: summary[k] for k in ("wall_s", "trainer_idle_fraction", "generate_train_overlap_fraction")}


ENGINE = SimEngineConfig(decode_s=0.02, knee=8, max_running=24, prefill_s_per_token=1e-4, load_s=0.5,
                         lengths=LengthModel(30, 0.5, 0.8))  # fmt: skip
TRAINER = TrainerCost(token_s=2e-4, microbatch_overhead_s=0.05, micro_batch_tokens=512, step_s=0.3)


def _config(**kw):
    base = dict(engine=ENGINE, trainer=TRAINER, replicas=2, prompts_per_step=4, group_size=4,
                max_new_tokens=400, prompt_len=16, steps=6)  # fmt: skip
    return SimConfig(**{**base, **kw})


@pytest.mark.parametrize("mode", MODES)
def test_samples_conserved_and_staleness_bounded(mode):
    config = _config(mode=mode, eta=3)
    result = simulate(config)
    counters = result.counters
    assert counters["groups_trained"] == config.steps * config.prompts_per_step
    assert sum(result.staleness.values()) == counters["groups_trained"]
    # every admitted group is trained or discarded (still generating at the end: run_end)
    admitted = counters["groups_trained"] + counters.get("groups_discarded", 0)
    assert admitted >= config.steps * config.prompts_per_step
    assert max(result.staleness) <= config.staleness
    assert len(result.step_times) == config.steps and result.step_s > 0
    assert 0 < result.generation_utilisation <= 1 and 0 < result.trainer_utilisation <= 1


def test_staleness_reaches_eta_in_async_and_modes_order_as_expected():
    results = {mode: simulate(_config(mode=mode, eta=2, replicas=1)) for mode in MODES}
    assert max(results["async"].staleness) == 2
    assert max(results["one_step"].staleness) == 1
    assert set(results["sync"].staleness) == {0}
    # streaming overlaps training with the batch's tail; async overlaps it with the next batch
    assert results["streaming"].step_s <= results["sync"].step_s
    assert results["async"].step_s < results["sync"].step_s


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_step_time_non_increasing_in_replicas(mode):
    times = [simulate(_config(mode=mode, replicas=n, eta=2)).step_s for n in (1, 2, 4, 8)]
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(times)), times
    assert times[-1] < times[0]


def test_trace_has_real_run_lanes_and_matches_utilisation():
    result = simulate(_config(mode="streaming"))
    names = {(e["args"]["name"]) for e in result.events if e["ph"] == "M"}
    assert {"rollout", "trainer", "replica0", "replica1"} <= names
    spans = {e["name"] for e in result.events if e["ph"] == "X"}
    assert {"decode", "prefill", "weight_load", "train_microbatch", "optimizer_step"} <= spans
    fractions = trace_fractions(result)
    wall = sum(result.step_times)
    assert fractions["wall_s"] == pytest.approx(wall, rel=0.05)
    assert 1 - fractions["trainer_idle_fraction"] == pytest.approx(result.trainer_utilisation, rel=0.05)


def test_sync_mode_trains_only_after_the_batch_is_in():
    result = simulate(_config(mode="sync", replicas=1))
    decode_end = max(e["ts"] + e["dur"] for e in result.events if e.get("name") == "decode" and e["ts"] < 1e12)
    first_train = min(e["ts"] for e in result.events if e.get("name") == "train_microbatch")
    first_step_end = result.step_times[0] * 1e6
    assert first_train < first_step_end < decode_end  # training of step 1 ends before later decoding
    steps = [e for e in result.events if e.get("name") == "decode" and e["ts"] + e["dur"] <= first_step_end]
    assert max(e["ts"] + e["dur"] for e in steps) <= first_train + 1e-3


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="mode"):
        _config(mode="fast")
    with pytest.raises(ValueError, match="replicas"):
        _config(replicas=0)
