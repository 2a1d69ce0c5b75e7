"""The failure budget: a reward or environment failing more than ``run.failure_budget`` of the last
``run.failure_window`` groups stops the run with one line (both schedules of the controller); one
failing now and then only costs its groups. Reports name what failed them (rollout side)."""

from __future__ import annotations

import asyncio

import pytest

from fakes import FakeEnv, FakeInferenceEngine, FakePipeline, FaultyReward
from sluice.api import GroupReport, PromptItem, SamplingParams
from sluice.controller.loop import Controller
from sluice.controller.push import PushAdmission
from sluice.queue import AsyncLocalQueue, LocalQueue
from sluice.queue.samples import SAMPLE_COLUMNS
from sluice.rewards import RewardService
from sluice.rollout.env_runner import ENV_FAILURE, EnvRunner
from sluice.rollout.episode import EpisodeLimits, EpisodeRunner
from sluice.rollout.groups import GroupRunner
from sluice.rollout.single_turn import SingleTurnWorkflow
from sluice.rollout.trajectory import ChatFormat
from sluice.schedule.failures import FailureBudget, FailureBudgetExceeded, RunStopped
from sluice.schedule.ledger import GroupLedger
from sluice.schedule.staleness import StalenessGate
from sluice.sim import run_virtual
from sluice.sim.task import SimTokenizer


def _report(gid: int, failed_by: str | None = None, error: str = "") -> GroupReport:
    reason = "reward_error:x" if failed_by else None
    return GroupReport(gid, 0, 2, 4, (0.0, 1.0), discard_reason=reason, failed_by=failed_by, error=error)


def test_a_source_failing_every_group_stops_once_over_budget_times_window():
    budget = FailureBudget(0.5, 8)
    for gid in range(4):  # 4 of 8 is the budget itself: still allowed
        budget.record(_report(gid, "reward 'exact_match'", "ValueError: boom"))
    with pytest.raises(FailureBudgetExceeded) as stop:
        budget.record(_report(4, "reward 'exact_match'", "ValueError: bang"))
    assert str(stop.value) == (
        "reward 'exact_match' failed 5 of the last 5 groups (budget 50 %); last error: ValueError: bang"
    )
    assert isinstance(stop.value, RunStopped) and "\n" not in str(stop.value)


def test_failures_older_than_the_window_no_longer_count():
    budget = FailureBudget(0.25, 8)  # at most 2 failures in any 8 consecutive groups
    for gid in range(400):  # every 4th group fails: 2 in each window of 8, never 3
        budget.record(_report(gid, "environment 'calc'" if gid % 4 == 0 else None, "env_error"))
    budget.record(_report(400, "environment 'calc'", "env_error"))  # 392 left the window: 396, 400
    over = r"environment 'calc' failed 3 of the last 8 groups \(budget 25 %\)"
    with pytest.raises(FailureBudgetExceeded, match=over):
        budget.record(_report(401, "environment 'calc'", "env_error"))  # 396, 400, 401: 3 in 8


def test_sources_are_counted_apart_and_a_full_budget_never_stops():
    budget = FailureBudget(0.5, 4)
    for gid in range(40):
        budget.record(_report(gid, "reward 'a'" if gid % 2 else "reward 'b'"))  # 2 of 4 each
    everything = FailureBudget(1.0, 4)
    for gid in range(40):
        everything.record(_report(gid, "reward 'a'"))


def _controller(pipeline, barrier: bool, budget: FailureBudget | None, eta: int = 1):
    ledger = GroupLedger(StalenessGate(4, 0 if barrier else eta))
    return Controller(pipeline, PushAdmission(pipeline, ledger, 4, barrier=barrier, failures=budget)), ledger


async def _keep_going(version, chosen, metrics):
    return True


@pytest.mark.parametrize("barrier", [False, True], ids=["async", "sync"])
def test_a_reward_that_always_fails_stops_the_controller_with_one_line(barrier):
    pipe = FakePipeline(lambda gid: 0.001, discard=lambda gid: True, failed_by="reward 'exact_match'")
    controller, ledger = _controller(pipe, barrier, FailureBudget(0.5, 64))
    with pytest.raises(FailureBudgetExceeded) as stop:
        asyncio.run(asyncio.wait_for(controller.run(3, _keep_going), timeout=30))
    assert str(stop.value).startswith("reward 'exact_match' failed 33 of the last 33 groups (budget 50 %)")
    assert str(stop.value).endswith("; last error: ValueError: group 32")  # the 33rd group (ids in order)
    assert pipe.steps == [[]]  # the first step never got a group
    assert ledger.discards["scripted"] >= 2 * 33  # the stopping group is counted too (and any in flight)
    assert len(ledger.groups) <= 33 + 8  # admission stopped with the run (at most a wave was out)


@pytest.mark.parametrize("barrier", [False, True], ids=["async", "sync"])
def test_a_reward_failing_one_group_in_ten_only_costs_its_groups(barrier):
    pipe = FakePipeline(lambda gid: 0.001, discard=lambda gid: gid % 10 == 3, failed_by="reward 'exact_match'")
    controller, ledger = _controller(pipe, barrier, FailureBudget(0.5, 64))
    asyncio.run(asyncio.wait_for(controller.run(10, _keep_going), timeout=30))
    assert [len(step) for step in pipe.steps] == [4] * 10
    assert ledger.discards["scripted"] == 2 * sum(1 for g in ledger.groups if g % 10 == 3) > 0


def test_the_single_turn_report_names_the_failed_reward_and_its_error():
    queue = LocalQueue()
    queue.register_task("train", SAMPLE_COLUMNS)
    workflow = SingleTurnWorkflow(SimTokenizer(), SamplingParams(max_new_tokens=4), group_size=2)
    for mode, error in [
        ("raise", "ValueError: scripted reward failure"),
        ("nan", "returned nan, not a finite number or a bool"),
    ]:
        service = RewardService(FaultyReward(mode), pool_size=0, name="faulty")
        runner = GroupRunner(FakeInferenceEngine(vocab=50), workflow, AsyncLocalQueue(queue), service)
        long, short = PromptItem(0, "p", (1, 2), {"bucket": "long"}), PromptItem(1, "q", (1, 2), {"bucket": "short"})

        async def wave(runner=runner, long=long, short=short):
            return await asyncio.gather(runner.run_group(long, 0), runner.run_group(short, 1))

        failed, fine = asyncio.run(wave())
        assert failed.failed_by == "reward 'faulty'" and failed.error == error
        assert failed.discard_reason == f"reward_{'error' if mode == 'raise' else 'invalid'}:faulty"
        assert fine.failed_by is None and fine.error == "" and fine.discard_reason is None


def test_the_env_report_names_the_failed_environment_and_its_last_error():
    tok = SimTokenizer()
    queue = LocalQueue()
    queue.register_task("train", SAMPLE_COLUMNS)
    episodes = EpisodeRunner(
        FakeInferenceEngine(vocab=50),
        lambda: FakeEnv(turns=3, fail=(1, "raise")),
        encode_prompt=tok.encode,
        encode=tok.encode,
        decode=tok.decode,
        chat=ChatFormat(turn_end="."),
        params=SamplingParams(4),
        limits=EpisodeLimits(max_turns=8, max_context=1000, turn_tokens=4),
    )
    runner = EnvRunner(episodes, AsyncLocalQueue(queue), group_size=2, name="calculator")

    async def wave():
        return [r async for r in runner.run_groups([(PromptItem(0, "", (), {}), 0)])]

    (report,) = run_virtual(wave())
    assert report.discard_reason == ENV_FAILURE
    assert report.failed_by == "environment 'calculator'"
    assert report.error.startswith("env_error: step")


def test_a_failing_reward_warns_once_per_reason_and_counts_every_call(caplog):
    service = RewardService(FaultyReward("raise", always=True), pool_size=0, name="faulty")

    async def score():
        return await asyncio.gather(*(service("abc") for _ in range(5)), return_exceptions=True)

    with caplog.at_level("WARNING", logger="sluice.rewards.service"):
        asyncio.run(score())
    assert len(caplog.records) == 1 and "reward_error:faulty" in caplog.records[0].getMessage()
    assert service.stats()["reward_error:faulty"] == 5.0
