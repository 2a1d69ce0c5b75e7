"""``sluice train`` with a reward that sleeps forever in the driver (``reward.pool_size: 0``): the
process exits on its own, within a bounded time, with the failure budget's one line and exit 1."""

import subprocess
import sys
import time

import pytest

from tiny import tiny_run_overrides

pytestmark = pytest.mark.faults


def test_sluice_train_exits_with_one_line_when_a_thread_reward_hangs_forever(tiny_task_model, tmp_path):
    reward = tmp_path / "hang.py"
    reward.write_text("import time\n\ndef forever(response, **_):\n    time.sleep(10**6)\n    return 1.0\n")
    run = ["run.mode=sync", "run.backend=local", "run.eval_every=0", "rollout.max_new_tokens=8"]
    budget = ["reward.pool_size=0", "reward.timeout_s=0.2", "run.failure_window=4", f"reward.fn={reward}:forever"]
    args = [*tiny_run_overrides(tiny_task_model, tmp_path, "hang"), *run, *budget]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "train", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 60
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: reward 'forever' failed 3 of the last 3 groups (budget 50 %); last error: no result within 0.2 s"
    ]
    assert "Traceback" not in done.stderr
