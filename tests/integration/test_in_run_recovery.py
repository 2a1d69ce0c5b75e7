"""In-run recovery without Ray (issue 42, item 3): the local backend's training loop stalls once
(a reward call that never returns, run in the driver's threads with a timeout longer than the
stall timeout); the watchdog names the stall, and ``fit`` continues from the last complete
checkpoint by itself: every admitted sample is trained exactly once, and the restart is a
``restart`` record with its cause. With ``run.max_restarts=0`` the same stall ends the run with
its one line."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from test_resume import _records, trained_ids

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from sluice.runtime.supervision import WorkerStalled
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration

STEPS, GROUPS, SAMPLES = 4, 4, 4


class HangsOnce:
    """``length_reward``, except that call number ``at`` never returns (until ``release``)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0
        self._lock, self._release = threading.Lock(), threading.Event()

    def __call__(self, response: str, **fields: Any) -> float:
        with self._lock:
            self.calls += 1
            hang = self.calls == self.at
        if hang:
            self._release.wait()
        return length_reward(response, **fields)

    def release(self) -> None:
        self._release.set()


def _overrides(model_dir, out, name, *extra):
    run = [*tiny_run_overrides(model_dir, out, name), "run.backend=local", "run.mode=async", f"run.steps={STEPS}"]
    run += ["rollout.max_new_tokens=8", "run.eval_every=0", "run.checkpoint_every=1", "reward.pool_size=0"]
    # the stall: a reward that never returns holds its group (no reward timeout within the run)
    return [*run, "reward.timeout_s=600", "run.stall_timeout_s=3", *extra]


def test_a_stalled_loop_restarts_from_its_checkpoint_and_trains_each_sample_once(tiny_task_model, tmp_path):
    reward = HangsOnce(at=2 * GROUPS * SAMPLES + 3)  # a call of step 3's groups
    try:
        result = RLTrainer(load_config(None, _overrides(tiny_task_model, tmp_path, "r")), reward=reward).fit()
    finally:
        reward.release()
    ids, steps = trained_ids(result.run_dir)
    assert steps == list(range(1, STEPS + 1))
    assert len(ids) == STEPS * GROUPS * SAMPLES and set(ids.values()) == {1}
    restarts = [r for r in _records(result.run_dir) if r["kind"] == "restart"]
    assert len(restarts) == 1, restarts
    assert restarts[0]["cause"].startswith("the training loop made no progress for "), restarts
    assert restarts[0]["restart"] == 1 and restarts[0]["max_restarts"] == 2
    assert restarts[0]["step"] >= 1 and restarts[0]["checkpoint"].endswith(f"step_{restarts[0]['step']:06d}")


def test_without_restarts_the_stall_ends_the_run_with_its_line(tiny_task_model, tmp_path):
    reward = HangsOnce(at=2 * GROUPS * SAMPLES + 3)
    cfg = load_config(None, _overrides(tiny_task_model, tmp_path, "r0", "run.max_restarts=0"))
    try:
        with pytest.raises(WorkerStalled, match=r"^the training loop made no progress for \d+ s .*resume=auto"):
            RLTrainer(cfg, reward=reward).fit()
    finally:
        reward.release()
    assert not [r for r in _records(tmp_path / "r0") if r["kind"] == "restart"]
