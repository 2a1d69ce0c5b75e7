"""Two driver processes on one run dir: while the first lives the second is refused, naming it;
once it is SIGKILLed (no cleanup) its lock is gone with it and the next driver takes over."""

import logging
import signal
import subprocess
import sys

import pytest

from host_probes import read_holder
from sluice.runtime.run_lock import RunDirBusy, run_dir_lock

pytestmark = pytest.mark.faults

HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from sluice.runtime.run_lock import run_dir_lock\n"
    "with run_dir_lock(Path(sys.argv[1])):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(120)\n"
)


def test_a_sigkilled_drivers_lock_dies_with_it_and_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=f"pid {first.pid} on "), run_dir_lock(run_dir):
            pass
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    assert read_holder(run_dir)["pid"] == first.pid  # the record stays; the lock did not
    with caplog.at_level(logging.WARNING, "sluice.runtime.run_lock"), run_dir_lock(run_dir):
        pass
    assert f"taking over the run dir lock of a driver that is gone (pid {first.pid} on" in caplog.text
