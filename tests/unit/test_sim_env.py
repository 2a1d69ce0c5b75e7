"""SimEnv (latency, fail-slow, fail-stop, crash on the virtual clock) and the agentic pipeline
under the real controller: redundant environments complete steps despite hung envs."""

from __future__ import annotations

import asyncio

import pytest
from harness.sim_agentic import SimAgenticPipeline
from harness.sim_env import SimEnv, SimEnvConfig, SimEnvCrash

from sluice.controller.loop import Controller
from sluice.controller.push import PushAdmission
from sluice.schedule.ledger import GroupLedger
from sluice.schedule.staleness import StalenessGate
from sluice.sim import LengthModel, SimEngine, SimEngineConfig, run_virtual

ENGINE = SimEngineConfig(decode_s=0.01, knee=1024, max_running=1024, load_s=0.0,
                         lengths=LengthModel(median=10, prompt_sigma=0.0, sample_sigma=0.0))  # fmt: skip


async def _episode(env: SimEnv, seed: int = 1) -> tuple[list[float], float]:
    loop = asyncio.get_running_loop()
    await env.reset(seed)
    times, reward, done = [], 0.0, False
    while not done:
        start = loop.time()
        step = await env.step("a")
        times.append(loop.time() - start)
        reward, done = step.reward, step.done
    return times, reward


def test_latency_is_a_clipped_gaussian_and_reproducible():
    config = SimEnvConfig(turns=2000, latency_mean_s=10.0, latency_std_s=10.0)
    times, _ = run_virtual(_episode(SimEnv(config, instance=3)))
    again, _ = run_virtual(_episode(SimEnv(config, instance=3)))
    other, _ = run_virtual(_episode(SimEnv(config, instance=4)))
    assert times == again and times != other
    assert min(times) == 0.0 and 0.1 < sum(t == 0.0 for t in times) / len(times) < 0.2  # P(N < 0) ≈ 0.16
    assert sum(times) / len(times) == pytest.approx(10.83, abs=0.6)  # mean of the clipped Gaussian
    fixed, _ = run_virtual(_episode(SimEnv(SimEnvConfig(turns=3, latency_mean_s=2.0))))
    assert fixed == [2.0, 2.0, 2.0]


def test_fail_slow_adds_its_delay_and_crash_raises():
    slow = SimEnvConfig(turns=200, latency_mean_s=1.0, fail_slow_prob=0.1, fail_slow_s=50.0)
    times, _ = run_virtual(_episode(SimEnv(slow)))
    assert set(times) == {1.0, 51.0} and 5 < times.count(51.0) < 40
    with pytest.raises(SimEnvCrash):
        run_virtual(_episode(SimEnv(SimEnvConfig(turns=5, crash_prob=1.0))))


def test_fail_stop_hangs_until_a_timeout():
    async def bounded() -> None:
        env = SimEnv(SimEnvConfig(turns=5, fail_stop_prob=1.0))
        await env.reset(0)
        await asyncio.wait_for(env.step("a"), 1000.0)

    with pytest.raises(TimeoutError):
        run_virtual(bounded())


def _run(env: SimEnvConfig, *, steps: int, redundancy: int, env_groups: int, timeout: float | None = None):
    pipeline = SimAgenticPipeline([SimEngine(ENGINE)], env, group_size=2, group_redundancy=redundancy,
                                  step_timeout_s=timeout, turn_tokens=16)  # fmt: skip
    ledger = GroupLedger(StalenessGate(4, 0), redundant_groups=env_groups - 4)
    controller = Controller(pipeline, PushAdmission(pipeline, ledger, 4))
    trained: list[list[int]] = []

    async def after_step(version: int, chosen: list[int], metrics: dict[str, float]) -> bool:
        trained.append(chosen)
        return True

    run_virtual(asyncio.wait_for(controller.run(steps, after_step), 10_000.0))
    return trained, pipeline.env_runner.counts, ledger


def test_redundant_envs_complete_steps_despite_fail_stop_envs():
    # a quarter of env steps hang forever and nothing times out: only redundancy can finish a step
    env = SimEnvConfig(turns=3, latency_mean_s=5.0, latency_std_s=2.0, fail_stop_prob=0.25)
    trained, counts, ledger = _run(env, steps=3, redundancy=6, env_groups=6)
    assert [len(step) for step in trained] == [4, 4, 4]
    assert counts["episodes_aborted_straggler"] > 0  # hung episodes were aborted, not waited for
    assert ledger.discards["redundant_groups"] > 0  # surplus env groups too
    assert sum(ledger.staleness.values()) == 12
    fates = ("kept", "finished_surplus", "aborted_straggler", "cancelled", "group_aborted", "group_failed",
             "env_timeout", "env_error")  # fmt: skip
    assert counts["episodes_started"] == sum(counts[f"episodes_{fate}"] for fate in fates)


def test_fail_stop_without_redundancy_fails_groups_by_timeout_and_still_trains():
    env = SimEnvConfig(turns=3, latency_mean_s=5.0, fail_stop_prob=0.05)
    trained, counts, ledger = _run(env, steps=2, redundancy=0, env_groups=4, timeout=30.0)
    assert [len(step) for step in trained] == [4, 4]
    assert counts["episodes_env_timeout"] > 0
    assert ledger.discards["env_failure"] == 2 * counts["episodes_env_timeout"]  # samples of failed groups
    fates = ("kept", "finished_surplus", "aborted_straggler", "cancelled", "group_aborted", "group_failed",
             "env_timeout", "env_error")  # fmt: skip
    assert counts["episodes_started"] == sum(counts[f"episodes_{fate}"] for fate in fates)
