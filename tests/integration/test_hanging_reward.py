"""A reward that never returns, run in the driver's threads (``reward.pool_size: 0``): the failure
budget stops the run within a bounded time, and nothing is left waiting for the hung calls (the
threads they run in are daemons nobody joins), so ``fit`` returns its one line and the process
can exit."""

import threading
import time

import pytest

from fakes import FaultyReward
from sluice import RLTrainer
from sluice.config import load_config
from sluice.schedule.failures import FailureBudgetExceeded
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_reward_that_hangs_forever_in_threads_stops_the_run_in_bounded_time(tiny_task_model, tmp_path, mode):
    run = [f"run.mode={mode}", "run.backend=local", "run.eval_every=0", "rollout.max_new_tokens=8"]
    budget = ["reward.pool_size=0", "reward.timeout_s=0.2", "run.failure_window=4"]
    config = load_config(None, [*tiny_run_overrides(tiny_task_model, tmp_path, "hang"), *run, *budget])
    trainer = RLTrainer(config, reward=FaultyReward("hang", always=True, hang_s=3600))
    started = time.monotonic()
    with pytest.raises(FailureBudgetExceeded, match=r"reward 'FaultyReward' failed 3 of the last 3 groups .*0\.2 s"):
        trainer.fit()  # before: asyncio.run's end joined the hung threads forever
    assert time.monotonic() - started < 20
    hung = [t for t in threading.enumerate() if t.name == "sluice-reward"]
    assert hung and all(t.daemon for t in hung)  # still sleeping, and no exit waits for them
