"""What a long run keeps in memory stays bounded: the controller drops a group's report once its
step is logged (and never keeps a discarded group's), and the JSONL logs keep no records."""

from __future__ import annotations

import asyncio
import tracemalloc

from fakes import FakePipeline, length_reward
from sluice.controller.loop import Controller
from sluice.controller.push import PushAdmission
from sluice.schedule.ledger import GroupLedger, GroupState
from sluice.schedule.staleness import StalenessGate
from sluice.telemetry.metrics import JsonlMetrics


def test_the_controller_holds_only_the_reports_of_groups_not_yet_trained() -> None:
    eta, per_step, steps = 2, 4, 30
    pipe = FakePipeline(lambda gid: 0.001 * (gid % 3), discard=lambda gid: "scripted" if gid % 7 == 3 else None)
    ledger = GroupLedger(StalenessGate(per_step, eta))
    controller = Controller(pipe, PushAdmission(pipe, ledger, per_step))
    held: list[int] = []

    async def after_step(version: int, chosen: list[int], metrics: dict[str, float]) -> bool:
        assert all(gid in controller.reports for gid in chosen)  # the step's statistics can read them
        held.append(len(controller.reports))
        return True

    asyncio.run(asyncio.wait_for(controller.run(steps, after_step), timeout=60))
    assert max(held) <= (eta + 2) * per_step  # the admission bound, not the run's length
    untrained = {gid for gid, g in ledger.groups.items() if g.state is GroupState.OPEN and g.generated}
    assert set(controller.reports) <= untrained  # ... and the run-end's discards are not kept either
    discarded = sum(g.discard_reason == "scripted" for g in ledger.groups.values())
    reported = steps * per_step + discarded + len(untrained)  # the watchdog still sees every report
    assert discarded > 0 and controller.progress() == (steps, reported)


def test_jsonl_logs_keep_no_records_in_memory(tmp_path) -> None:
    ids = [f"{step}-{k}" for step in range(2) for k in range(128)]
    log = JsonlMetrics(None)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for step in range(2_000):  # a long run's trained-ids log: every sample id of every step
            log.log("trained", step=step, ids=[f"{i}-{step}" for i in ids])
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1_000_000, grown
    on_disk = JsonlMetrics(tmp_path / "metrics.jsonl")
    on_disk.log("train", step=1, loss=0.5)
    assert '"loss": 0.5' in (tmp_path / "metrics.jsonl").read_text()


class _CountingGroups(dict):
    """A ledger's ``groups`` that counts full scans."""

    scans = 0

    def values(self):  # type: ignore[override]
        _CountingGroups.scans += 1
        return super().values()


def test_the_ledgers_per_report_questions_never_scan_every_group() -> None:
    """A long run's ledger holds every group ever admitted; admission, choosing and surplus read
    only the live ones (else the driver's work per step grows with the run: ~0.9 s a step at step
    500 of the default task's shape), and answer as a full scan would."""
    per_step, eta, steps = 4, 2, 40
    pipe = FakePipeline(lambda gid: 0.001 * (gid % 5), discard=lambda gid: gid % 9 == 4)
    groups = _CountingGroups()
    ledger = GroupLedger(StalenessGate(per_step, eta), groups=groups, redundant_groups=2)
    controller = Controller(pipe, PushAdmission(pipe, ledger, per_step))
    _CountingGroups.scans = 0
    checked = []

    async def after_step(version: int, chosen: list[int], metrics: dict[str, float]) -> bool:
        every = list(dict.values(groups))
        live = [g for g in every if g.state not in (GroupState.TRAINED, GroupState.DISCARDED)]
        assert ledger.in_flight == sum(not g.generated for g in live)
        assert ledger.accepted == sum(g.generated and g.state is not GroupState.DISCARDED for g in every)
        generating = [g.version for g in live if not g.generated]
        assert ledger.oldest_generating() == min(generating, default=None)
        checked.append(len(live))
        return True

    asyncio.run(asyncio.wait_for(controller.run(steps, after_step), timeout=60))
    assert _CountingGroups.scans == 0 and len(checked) == steps
    assert len(groups) > steps * per_step and max(checked) <= (eta + 2) * per_step + 2


def test_the_pipelines_queue_frees_each_row_once_every_task_read_it(tiny_task_model, tmp_path) -> None:
    """The queue held every sample the run generated (0.8 MB a step of the default task in the
    soak run's storage actor); a trained row is freed now, so it holds the rows in flight only."""
    from sluice import RLTrainer
    from sluice.config import load_config
    from sluice.runtime.pipelines import LocalPipeline
    from tiny import tiny_run_overrides

    per_step, eta, group_size, steps = 4, 1, 4, 6
    overrides = [*tiny_run_overrides(tiny_task_model, tmp_path, "free"), "run.backend=local", "reward.pool_size=0"]
    trainer = RLTrainer(load_config(None, [*overrides, "rollout.max_new_tokens=6"]), reward=length_reward)
    trainer.init_engines()
    trainer.load_prompt_data()
    pipeline = LocalPipeline(trainer.pipeline_spec(), trainer.prompts)
    controller = Controller(pipeline, PushAdmission(pipeline, GroupLedger(StalenessGate(per_step, eta)), per_step))
    held: list[int] = []

    async def after_step(version: int, chosen: list[int], metrics: dict[str, float]) -> bool:
        held.append(pipeline.queue.stats()["rows"])
        return True

    try:
        asyncio.run(asyncio.wait_for(controller.run(steps, after_step), timeout=300))
    finally:
        pipeline.close()
    assert len(held) == steps and max(held) <= (eta + 1) * per_step * group_size, held
