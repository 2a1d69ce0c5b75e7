"""In-run recovery without Ray (issue 42, item 3): the local backend's training loop stalls once
or twice (a reward call that never returns, run in the driver's threads with a timeout longer than the
stall timeout); the watchdog names the stall, and ``fit`` continues from the last complete
checkpoint by itself: every admitted sample is trained exactly once, and the restart is a
``restart`` record with its cause. With ``run.max_restarts=0`` the same stall ends the run with
its one line."""

from __future__ import annotations

import os
import signal
import threading
import time
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


class Hangs:
    """``length_reward``, except that call number ``at`` never returns (until ``release``), and,
    ``times`` > 1, again the first call made 2 s after the last hang began (after the in-flight
    calls of the stalled attempt: in the restarted one, stall timeout 3 s)."""

    def __init__(self, at: int, times: int = 1) -> None:
        self.at, self.left, self.calls = at, times, 0
        self.hung_at: float | None = None
        self._lock, self._release = threading.Lock(), threading.Event()

    def __call__(self, response: str, **fields: Any) -> float:
        with self._lock:
            self.calls += 1
            due = self.calls == self.at if self.hung_at is None else time.monotonic() - self.hung_at > 2.0
            hang = due and self.left > 0
            if hang:
                self.left, self.hung_at = self.left - 1, time.monotonic()
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


HANG = 2 * GROUPS * SAMPLES + 3
"""A reward call of step 3's groups."""


@pytest.mark.parametrize("hangs", [1, 2], ids=["once", "twice"])
def test_a_stalled_loop_restarts_from_its_checkpoint_and_trains_each_sample_once(tiny_task_model, tmp_path, hangs):
    """``twice``: the second stall comes in the regenerated step 3, before a newer checkpoint, so
    the second restart cuts the logs back to the same checkpoint: the first restart's record,
    cut with them, is written again."""
    reward = Hangs(HANG, times=hangs)
    try:
        result = RLTrainer(load_config(None, _overrides(tiny_task_model, tmp_path, "r")), reward=reward).fit()
    finally:
        reward.release()
    ids, steps = trained_ids(result.run_dir)
    assert steps == list(range(1, STEPS + 1))
    assert len(ids) == STEPS * GROUPS * SAMPLES and set(ids.values()) == {1}
    restarts = [r for r in _records(result.run_dir) if r["kind"] == "restart"]
    assert [r["restart"] for r in restarts] == list(range(1, hangs + 1)), restarts
    for record in restarts:
        assert record["cause"].startswith("the training loop made no progress for "), restarts
        assert record["max_restarts"] == 2 and record["step"] >= 1, restarts
        assert record["checkpoint"].endswith(f"step_{record['step']:06d}"), restarts


def test_without_restarts_the_stall_ends_the_run_with_its_line(tiny_task_model, tmp_path):
    reward = Hangs(HANG)
    cfg = load_config(None, _overrides(tiny_task_model, tmp_path, "r0", "run.max_restarts=0"))
    try:
        with pytest.raises(WorkerStalled, match=r"^the training loop made no progress for \d+ s .*resume=auto"):
            RLTrainer(cfg, reward=reward).fit()
    finally:
        reward.release()
    assert not [r for r in _records(tmp_path / "r0") if r["kind"] == "restart"]


class SignalsThenHangs(Hangs):
    """The first call (the base evaluation's) sends this process SIGTERM, then never returns."""

    def __call__(self, response: str, **fields: Any) -> float:
        if self.calls == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # the run's handler (main thread): a stop request
        return super().__call__(response, **fields)


def test_sigterm_during_a_base_evaluation_that_never_ends_stops_the_run_within_the_stall_timeout(
    tiny_task_model, tmp_path
):
    """Start-up runs under the watchdog too: the stop the signal asks for cannot come (the base
    evaluation waits on a reward that never returns), so the run ends ``run.stall_timeout_s``
    after the signal with the watchdog's line, and is not restarted (a signal is never recovered
    from). Without it the run would wait for the reward: released after 20 s here, the run would
    then stop at its start with ``RunPreempted`` instead."""
    reward = SignalsThenHangs(at=1)
    threading.Timer(20.0, reward.release).start()
    cfg = load_config(None, _overrides(tiny_task_model, tmp_path, "term", "run.eval_every=2"))
    started = time.monotonic()
    try:
        with pytest.raises(WorkerStalled, match=r"^the training loop did not stop when asked to for \d+ s"):
            RLTrainer(cfg, reward=reward).fit()
    finally:
        reward.release()
    assert time.monotonic() - started < 15.0
    assert not (tmp_path / "term" / "trained_ids.jsonl").read_text()
