"""Every actor of a Ray run answers the watchdog's heartbeat (issue 42, item 2), so a signal
always ends the run in bounded time.

Before, a SIGSTOPped queue storage unit was never noticed, and SIGTERM then did not stop the run
either. Here a ``sluice train`` (its own Ray instance, in-run recovery off: ``run.max_restarts=0``)
has its storage unit stopped, then gets SIGTERM: it ends within the stall timeout plus its
teardown, exit 1, its last line the one line naming the storage unit, no traceback, no process
left. (Each actor's stall named within the timeout, and recovered from: ``test_in_run_recovery.py``;
a stopped reward worker: ``test_worker_faults.py``.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_resume import _steps_logged, _wait_for

from faults.test_worker_faults import STALL_S, _overrides
from sluice.runtime.processes import run_tag, tagged_processes

pytestmark = [pytest.mark.integration, pytest.mark.faults]

NAMED_WITHIN_S = STALL_S + 2 * min(5.0, STALL_S / 4) + 5.0
"""The timeout, the watchdog's two look intervals, and slack for a loaded machine."""


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
