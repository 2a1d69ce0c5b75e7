"""Every actor of a Ray run answers the watchdog's heartbeat (issue 42, item 2).

A SIGSTOPped queue storage unit, queue controller, weight registry or queue-task (``ref``) worker
sends no heartbeat: the run names it in one line within ``run.stall_timeout_s`` (before, a stopped
storage unit was never noticed; a stopped reward worker's case is in ``test_worker_faults.py``).
With in-run recovery off (``run.max_restarts=0``) the run stops
with that line; the stopped process does not outlive the run. And a ``sluice train`` whose
storage unit is stopped and that then gets SIGTERM ends within a bound, its last line the one
line, no traceback (before, SIGTERM did not stop it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_resume import _steps_logged, _wait_for

from fakes import length_reward
from faults.test_worker_faults import _actor_pids, _overrides
from sluice import RLTrainer
from sluice.config import load_config
from sluice.runtime.processes import run_tag, tagged_processes
from sluice.runtime.supervision import WorkerStalled

pytestmark = [pytest.mark.integration, pytest.mark.faults]

STALL_S = 15.0
"""``run.stall_timeout_s`` of these runs (``_overrides``)."""
NAMED_WITHIN_S = STALL_S + 2 * min(5.0, STALL_S / 4) + 5.0
"""The timeout, the watchdog's two look intervals, and slack for a loaded machine."""


def _stop_after_step(run_dir: Path, title: str, step: int = 2) -> tuple[threading.Thread, list[float]]:
    """In the background: once ``step`` is trained, SIGSTOP the one actor titled ``title``; the
    list gets the time of the signal."""
    when: list[float] = []

    def act() -> None:
        _wait_for(lambda: _steps_logged(run_dir) >= step, f"step {step}", timeout=600)
        pids = _actor_pids(title)
        assert len(pids) == 1, f"{title}: {pids}"
        os.kill(pids[0], signal.SIGSTOP)
        when.append(time.monotonic())

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread, when


@pytest.mark.parametrize(
    ("title", "worker", "extra"),
    [
        ("ray::StorageActor", "the queue storage unit sent no heartbeat", ()),
        ("ray::ControllerActor", "the queue controller of task 'train' sent no heartbeat", ()),
        ("ray::_Registry", "the weight registry sent no heartbeat", ()),
        ("ray::NodeTaskWorker", "the 'reference' task worker sent no heartbeat", ("trainer.kl_coef=0.05",)),
    ],
    ids=["storage", "controller", "registry", "ref-worker"],
)
def test_a_stopped_actor_is_named_within_the_timeout(tiny_task_model, tmp_path, ray_cluster, title, worker, extra):
    overrides = _overrides(tiny_task_model, tmp_path, "stalled", "run.max_restarts=0", *extra)
    fault, when = _stop_after_step(tmp_path / "stalled", title)
    with pytest.raises(WorkerStalled) as stop:
        RLTrainer(load_config(None, overrides), reward=length_reward).fit()
    ended = time.monotonic()
    fault.join()
    assert str(stop.value).startswith(worker) and "\n" not in str(stop.value), stop.value
    said_after = float(str(stop.value).split(" for ")[1].split(" s ")[0])
    assert STALL_S <= said_after <= NAMED_WITHIN_S, stop.value
    assert ended - when[0] < NAMED_WITHIN_S + 30, "the run took too long to close after the stall"  # its teardown
    deadline = time.monotonic() + 30  # ray.kill returns before the process has exited
    while _actor_pids(title) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _actor_pids(title), "the stopped actor outlived its run"


def test_sigterm_ends_a_run_whose_storage_unit_is_stopped_with_one_line(tiny_task_model, tmp_path):
    """``sluice train`` (its own Ray instance): the storage unit is SIGSTOPped after step 2, then
    the driver gets SIGTERM. The run ends within the stall timeout (plus its teardown) with exit 1
    and one line naming the storage unit, the last thing it prints; no traceback."""
    run_dir, out = tmp_path / "sigterm", tmp_path / "out.txt"
    args = _overrides(tiny_task_model, tmp_path, "sigterm", "run.max_restarts=0", "run.progress=false")
    with out.open("ab") as sink:
        driver = subprocess.Popen([sys.executable, "-m", "sluice.cli", "train", *args], stdout=sink, stderr=sink)
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 2 or driver.poll() is not None, "step 2", timeout=600)
        assert driver.poll() is None, out.read_text()[-3000:]
        pids = [p.pid for p in tagged_processes(run_tag(run_dir)) if p.name.startswith("ray::StorageActor")]
        assert len(pids) == 1, tagged_processes(run_tag(run_dir))
        os.kill(pids[0], signal.SIGSTOP)
        time.sleep(1.0)
        os.kill(driver.pid, signal.SIGTERM)
        signalled = time.monotonic()
        rc = driver.wait(timeout=NAMED_WITHIN_S + 60)
        took = time.monotonic() - signalled
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    said = out.read_text()
    lines = [line for line in said.splitlines() if line.strip()]
    assert rc == 1, said[-3000:]
    assert took < NAMED_WITHIN_S + 45, took
    assert lines[-1].startswith("error: the queue storage unit sent no heartbeat") or lines[-1].startswith(
        "error: the training loop did not stop when asked to"
    ), said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    deadline = time.monotonic() + 30
    while (left := tagged_processes(run_tag(run_dir))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of the run outlived it: {left}"
