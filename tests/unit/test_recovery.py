"""Which stops in-run recovery restarts a run after, and its budget (``controller/recovery.py``),
without a run: a worker's death or stall restarts it while the budget lasts, each counted and
said; a signal's stop, a spent failure budget or a refused write never does; after a restart the
checkpoints open as ``resume=auto``."""

from __future__ import annotations

import logging

import pytest

from sluice.config import load_config
from sluice.controller.recovery import Recovery
from sluice.runtime.preemption import RunPreempted
from sluice.runtime.supervision import WorkerDied, WorkerStalled
from sluice.schedule.failures import RunStopped
from sluice.telemetry.disk_faults import DiskFault


def test_deaths_and_stalls_restart_the_run_until_the_budget_is_spent(caplog):
    recovery = Recovery(budget=2)
    died = WorkerDied("trainer", "pid 7, killed")
    stalled = WorkerStalled("queue storage unit", 16.0, "sent no heartbeat")
    with caplog.at_level(logging.WARNING, logger="sluice.controller.recovery"):
        assert recovery.restarts(died, stop_asked=False)
        assert recovery.restarts(stalled, stop_asked=False)
        assert not recovery.restarts(died, stop_asked=False)  # past run.max_restarts: the line ends the run
    assert recovery.causes == [
        "the trainer died (pid 7, killed)",
        "the queue storage unit sent no heartbeat for 16 s (stopped or hung)",
    ]
    assert "restart 1 of 2 (run.max_restarts): the trainer died (pid 7, killed)" in caplog.text
    assert "restart 2 of 2" in caplog.text and "restart 3" not in caplog.text


@pytest.mark.parametrize(
    "err",
    [
        RunPreempted(15, 3, None),
        RunStopped("reward 'exact_match' failed 33 of the last 33 groups (budget 50 %)"),
        DiskFault("no space left on device (ENOSPC)", "runs/x/metrics.jsonl"),
        ValueError("a bug"),
    ],
    ids=["signal", "failure-budget", "disk", "bug"],
)
def test_other_stops_are_never_restarted(err):
    assert not Recovery(budget=5).restarts(err, stop_asked=False)


def test_a_stall_after_a_stop_request_is_not_restarted():
    """SIGTERM asked the run to stop: the watchdog's bound on that stop must end the run."""
    assert not Recovery(budget=5).restarts(WorkerStalled("training loop", 20.0, "did not stop"), stop_asked=True)


def test_after_a_restart_the_checkpoints_open_as_resume_auto():
    recovery, cfg = Recovery(budget=1), load_config(None, ["run.steps=4"])
    assert recovery.config(cfg) is cfg and cfg.run.resume is None
    recovery.restarts(WorkerDied("weight registry", "pid 9"), stop_asked=False)
    assert recovery.config(cfg).run.resume == "auto" and recovery.config(cfg).run.steps == 4
