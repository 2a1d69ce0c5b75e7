"""The reward service: process pool off the event loop, per-call timeout, failures counted."""

import asyncio
import time

import pytest

from fakes import FakeInferenceEngine, FaultyReward, async_length_reward, length_reward, matches_reward
from sluice.api import PromptItem, RewardFailure, SamplingParams
from sluice.config import RewardConfig
from sluice.rewards import REWARDS, RewardService, build_reward_service, exact_match_reward, math_verify_reward
from sluice.rollout.filters import reward_failure
from sluice.rollout.single_turn import SingleTurnWorkflow

CASES = [("12345", {"answer": "54321"}), ("abc", {}), ("", {"bucket": "short"}), ("x" * 20, {"answer": "1"})]


def _score_all(service, cases):
    async def go():
        return await asyncio.gather(*(service(text, **fields) for text, fields in cases))

    return asyncio.run(go())


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_pool_results_equal_in_process_results(start_method):
    service = RewardService(length_reward, pool_size=2, start_method=start_method)
    try:
        assert _score_all(service, CASES) == [length_reward(t, **f) for t, f in CASES]
        # a second event loop (the sync loop runs one per step) reuses the same processes
        pids = {w.process.pid for w in service.pool._workers}
        assert _score_all(service, CASES) == [length_reward(t, **f) for t, f in CASES]
        assert {w.process.pid for w in service.pool._workers} == pids
    finally:
        service.close()
    assert service.stats()["reward_calls"] == 2 * len(CASES)


def test_async_rewards_run_in_the_pool_and_in_threads():
    for pool_size in (1, 0):
        service = RewardService(async_length_reward, pool_size=pool_size)
        try:
            assert _score_all(service, CASES) == [length_reward(t, **f) for t, f in CASES]
        finally:
            service.close()


def test_closures_and_lambdas_reach_the_pool_by_value():
    """TRL users' habit: a reward closing over a local variable, or a lambda, defined in their
    script; plain pickle refuses both, the pool gets them by value."""
    target = "42"

    def matches_target(response, **_):
        return response == target

    for fn, want in ((matches_target, [1.0, 0.0]), (lambda response, **_: float(len(response)), [2.0, 1.0])):
        service = RewardService(fn, pool_size=1)
        try:
            assert _score_all(service, [("42", {}), ("4", {})]) == want
        finally:
            service.close()
        assert not service.failures


@pytest.mark.parametrize("pool_size", [1, 0])
def test_a_bool_reward_scores_one_or_zero(pool_size):
    """``return pred == gt`` is a reward: True is 1.0 and False 0.0, not an invalid value."""
    service = RewardService(matches_reward, pool_size=pool_size)
    try:
        assert _score_all(service, [("42", {"answer": "42"}), ("41", {"answer": "42"})]) == [1.0, 0.0]
    finally:
        service.close()
    assert not service.failures


@pytest.mark.parametrize("pool_size", [1, 0])
@pytest.mark.parametrize(
    ("mode", "kind"), [("raise", "error"), ("nan", "invalid"), ("text", "invalid"), ("hang", "timeout")]
)
def test_failures_raise_reward_failure_and_are_counted_per_function(mode, kind, pool_size):
    service = RewardService(FaultyReward(mode, hang_s=3.0), pool_size=pool_size, timeout_s=0.5, name="faulty")
    try:
        results = _score_all_settled(service, [("12", {"bucket": "long"}), ("12", {"bucket": "short"})])
    finally:
        service.close()
    failure, fine = results
    assert isinstance(failure, RewardFailure)
    assert failure.reason == f"reward_{kind}:faulty"
    assert fine == length_reward("12")
    assert service.stats()[f"reward_{kind}:faulty"] == 1.0


def _score_all_settled(service, cases):
    async def go():
        return await asyncio.gather(*(service(text, **fields) for text, fields in cases), return_exceptions=True)

    return asyncio.run(go())


def test_timeout_kills_the_hung_worker_and_the_pool_keeps_serving():
    service = RewardService(FaultyReward("hang", always=True, hang_s=60.0), pool_size=1, timeout_s=0.3)
    try:
        hung = service.pool
        started = time.monotonic()
        (failure,) = _score_all_settled(service, [("1", {})])
        assert isinstance(failure, RewardFailure) and failure.kind == "timeout"
        assert time.monotonic() - started < 10  # not the 60 s the reward wanted
        assert hung.replaced == 1
        (old,) = [w.process for w in hung._workers]
        assert old.is_alive()  # the replacement; the hung one is gone
        service.fn = length_reward
        assert _score_all(service, [("abcd", {})]) == [0.5]
    finally:
        service.close()


def test_scoring_does_not_block_the_event_loop():
    """A slow reward runs in another process: the loop keeps ticking meanwhile."""
    service = RewardService(FaultyReward("hang", always=True, hang_s=0.6), pool_size=1, timeout_s=5.0)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    async def go():
        tick = asyncio.ensure_future(ticker())
        value = await service("1")
        tick.cancel()
        return value

    try:
        assert asyncio.run(go()) == 1.0
    finally:
        service.close()
    assert ticks >= 10


def test_failed_reward_marks_the_samples_and_the_filter_names_the_reason():
    workflow = SingleTurnWorkflow(_CharTokenizer(), SamplingParams(max_new_tokens=4), group_size=3)
    service = RewardService(FaultyReward("raise"), pool_size=1, name="faulty")
    long_item = PromptItem(0, "p", (1, 2), {"bucket": "long"})
    short_item = PromptItem(1, "q", (1, 2), {"bucket": "short"})

    async def go():
        engine = FakeInferenceEngine()
        return await asyncio.gather(
            workflow.run(long_item, 0, engine, service), workflow.run(short_item, 1, engine, service)
        )

    try:
        failed, fine = asyncio.run(go())
    finally:
        service.close()
    assert reward_failure(failed) == "reward_error:faulty"
    assert all(s.reward != s.reward for s in failed)  # NaN: never trained, the group is discarded
    assert reward_failure(fine) is None
    assert service.stats()["reward_error:faulty"] == 3.0


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_builtin_registry_and_config_selection():
    assert set(REWARDS) == {"exact_match", "math_verify", "code_exec"}
    service = build_reward_service(RewardConfig(name="exact_match", pool_size=0), default=length_reward)
    assert service.fn is exact_match_reward and service.__name__ == "exact_match"
    default = build_reward_service(RewardConfig(pool_size=0), default=length_reward)
    assert default.fn is length_reward and default.__name__ == "length_reward"


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("so x = 0.5", "\\frac{1}{2}", 1.0),
        ("The answer is $\\sqrt{4}$", "2", 1.0),
        ("The answer is 3", "2", 0.0),
        ("no idea", "2", 0.0),
    ],
)
def test_math_verify_reward(response, answer, expected):
    assert math_verify_reward(response, answer=answer) == expected


def test_math_verify_rejects_an_unparsable_reference():
    with pytest.raises(ValueError, match="reference answer"):
        math_verify_reward("1", answer="")


def test_reward_latency_waits_a_drawn_gaussian_before_scoring():
    """``reward.latency_s``: a remote service's wait before each call (mean and deviation μ,
    clipped at 0), spent waiting, not computing."""
    import random
    import time

    from sluice.rewards.service import RewardService

    service = RewardService(lambda response, **_: float(len(response)), pool_size=0, latency_s=0.1, seed=3)
    draws = random.Random(3)
    expected = [max(0.0, draws.gauss(0.1, 0.1)) for _ in range(3)]

    async def three():
        started, cpu = time.perf_counter(), time.process_time()
        values = [await service("abc") for _ in range(3)]
        return values, time.perf_counter() - started, time.process_time() - cpu

    values, wall, cpu = asyncio.run(three())
    assert values == [3.0] * 3 and wall >= sum(expected) > 0
    assert cpu < wall  # waited, did not spin
