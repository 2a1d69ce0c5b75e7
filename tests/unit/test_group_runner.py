"""GroupRunner over simulated replicas (virtual clock): queue scheduling stores each group as
soon as it is scored, batch scheduling waits for the whole wave; rewards overlap generation;
aborted groups stop their requests and report the reason; the filter discards groups."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from sluice.api import SamplingParams
from sluice.queue import AsyncLocalQueue, LocalQueue
from sluice.queue.samples import SAMPLE_COLUMNS
from sluice.rollout.filters import zero_signal
from sluice.rollout.groups import GroupRunner
from sluice.rollout.proxy import LLMProxy
from sluice.rollout.single_turn import SingleTurnWorkflow
from sluice.sim import LengthModel, SimEngine, SimEngineConfig, run_virtual
from sluice.sim.task import SimReward, SimTokenizer, sim_prompts

CONFIG = SimEngineConfig(decode_s=0.01, prefill_s_per_token=0.0, lengths=LengthModel(100, 1.0, 0.3, seed=1))


def _runner(scheduling: str, reward_s: float = 0.0, engines: int = 2, group_filter=None):
    queue = LocalQueue()
    queue.register_task("train", SAMPLE_COLUMNS)
    replicas = [SimEngine(CONFIG) for _ in range(engines)]
    workflow = SingleTurnWorkflow(SimTokenizer(), SamplingParams(5000), group_size=4, run_seed=0)
    runner = GroupRunner(
        LLMProxy(replicas), workflow, AsyncLocalQueue(queue), SimReward(reward_s),
        group_filter=group_filter, scheduling=scheduling,  # type: ignore[arg-type]
    )  # fmt: skip
    return runner, queue, replicas


def _wave(runner: GroupRunner, groups: int, abort: tuple[int, ...] = ()):
    items = sim_prompts(groups, signal_fraction=0.5, seed=2)

    async def main():
        loop = asyncio.get_running_loop()
        reports = []
        stream = runner.run_groups([(item, gid) for gid, item in enumerate(items)])
        async for report in stream:
            reports.append((loop.time(), report))
            if abort and len(reports) == 1:
                runner.abort_groups(list(abort), "redundant")
        return reports

    return run_virtual(main())


def test_queue_scheduling_reports_groups_as_they_finish_and_overlaps_rewards():
    queue_runner, queue, _ = _runner("queue", reward_s=0.5)
    queue_reports = _wave(queue_runner, 6)
    batch_runner, _, _ = _runner("batch", reward_s=0.5)
    batch_reports = _wave(batch_runner, 6)
    queue_times = [t for t, _ in queue_reports]
    batch_times = [t for t, _ in batch_reports]
    assert len(set(batch_times)) == 1  # the barrier: every group reported at once
    assert len(set(queue_times)) == 6 and max(queue_times) <= batch_times[0]
    assert min(queue_times) < batch_times[0] / 2  # short groups did not wait for the long one
    by_gid = {r.group_id: replace(r, finished_at=0) for _, r in queue_reports}
    assert by_gid == {r.group_id: replace(r, finished_at=0) for _, r in batch_reports}  # same samples, rewards
    assert queue.stats()["rows"] == 6 * 4
    # the last group's rewards ran while other samples were still generating: no 0.5 s tail per
    # group, only one for the last sample of the wave
    longest = max(r.response_tokens / 4 for r in by_gid.values())
    assert max(queue_times) < 0.01 * longest * 4 + 0.5 * 2


def test_aborted_groups_stop_their_requests_and_report_the_reason():
    runner, queue, engines = _runner("queue")
    reports = _wave(runner, 6, abort=(3, 4, 5))
    reasons = {r.group_id: r.discard_reason for _, r in reports}
    assert len(reasons) == 6
    aborted = [g for g in (3, 4, 5) if reasons[g] == "redundant"]
    assert aborted, "no group was still running when the first finished"
    assert all(reasons[g] is None for g in (0, 1, 2))
    assert queue.stats()["rows"] == 4 * (6 - len(aborted))
    assert all(e.stats()["running"] == 0 and e.stats()["waiting"] == 0 for e in engines)


def test_filter_discards_groups_without_signal_before_they_reach_the_queue():
    runner, queue, _ = _runner("queue", group_filter=zero_signal)
    reports = [r for _, r in _wave(runner, 8)]
    dropped = [r for r in reports if r.discard_reason == "zero_signal"]
    assert dropped and all(len(set(r.rewards)) == 1 for r in dropped)
    assert queue.stats()["rows"] == 4 * (8 - len(dropped))
