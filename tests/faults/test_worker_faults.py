"""Worker faults in a real Ray run (tiny model): SIGKILL or SIGSTOP of one actor mid-run.

A killed or stopped rollout worker (or reward worker) is replaced (and re-synced), its unreported
groups regenerated (counted), and the run finishes training every admitted sample exactly once.
With in-run recovery off (``run.max_restarts=0``), a killed or stopped trainer ends the run
within the stall timeout with one line naming it; ``resume=auto`` then finishes the run, again
training every admitted sample exactly once (in-run recovery from every actor's death or stall:
``test_in_run_recovery.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from test_resume import _records, _steps_logged, _wait_for, trained_ids

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from sluice.runtime.processes import run_tag, tagged_processes
from sluice.schedule.failures import RunStopped
from tiny import tiny_run_overrides

pytestmark = [pytest.mark.integration, pytest.mark.faults]

STEPS = 5
GROUPS, SAMPLES = 4, 4
STALL_S = 8.0
"""``run.stall_timeout_s`` of these runs: a stopped trainer (or queue actor, registry) is named
within it plus the watchdog's two looks, a stopped rollout worker is replaced after half of it.
Short, since each stopped case waits it out; a heartbeat is answered in its own concurrency group
(a busy actor still answers within a second here), and a worker's first answer (its start-up)
has ``FIRST_ANSWER_S``."""


def _overrides(model_dir: Path, out: Path, name: str, *extra: str) -> list[str]:
    run = [*tiny_run_overrides(model_dir, out, name), "rollout.max_new_tokens=12", "reward.pool_size=0"]
    run += ["task.eval_prompts=4", "run.eval_every=0", f"run.steps={STEPS}", "run.backend=ray", "run.mode=async"]
    return [*run, "rollout.max_staleness=1", "run.checkpoint_every=1", f"run.stall_timeout_s={STALL_S}", *extra]


def _actor_pids(title: str, parent_title: str | None = None) -> list[int]:
    """This test's processes (descendants of pytest: its local Ray instance's workers) whose
    command line (Ray sets ``ray::<Class>[.method]``) starts with ``title`` (and whose parent's
    holds ``parent_title``)."""
    parents, titles = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                titles[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError, ValueError):
                continue

    def mine(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    def under(pid: int) -> bool:
        return parent_title is None or parent_title in titles.get(parents.get(pid, 0), "")

    return [pid for pid, name in titles.items() if name.startswith(title) and mine(pid) and under(pid)]


def _fault_after_step(
    run_dir: Path, title: str, sig: signal.Signals, step: int = 2, parent_title: str | None = None, of: int = 1
) -> threading.Thread:
    """In the background: once ``step`` is trained, send ``sig`` to the actor titled ``title`` (the
    first of the ``of`` such actors)."""

    def act() -> None:
        _wait_for(lambda: _steps_logged(run_dir) >= step, f"step {step}", timeout=600)
        pids = _actor_pids(title, parent_title)
        assert len(pids) == of, f"{title}: {pids}"
        os.kill(min(pids), sig)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


def _assert_each_sample_once(run_dir: Path, run_steps: int = STEPS) -> None:
    """Every admitted sample trained exactly once, and none of the run's processes left."""
    ids, steps = trained_ids(run_dir)
    assert steps == list(range(1, run_steps + 1))
    assert len(ids) == run_steps * GROUPS * SAMPLES and set(ids.values()) == {1}
    deadline = time.monotonic() + 30
    while (left := tagged_processes(run_tag(run_dir))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of the run outlived it: {left}"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_lost_rollout_worker_is_replaced_and_the_run_finishes(tiny_task_model, tmp_path, ray_cluster, sig):
    # rewards that wait (a remote service): the rollout, not the trainer, is the slow side, so the
    # kill finds groups in flight (an idle rollout waiting on the staleness gate has none to regenerate)
    cfg = load_config(None, [*_overrides(tiny_task_model, tmp_path, "rollout"), "reward.latency_s=0.2"])
    fault = _fault_after_step(tmp_path / "rollout", "ray::RolloutWorker", sig)
    result = RLTrainer(cfg, reward=length_reward).fit()
    fault.join()
    _assert_each_sample_once(result.run_dir)
    fates = next(r for r in _records(result.run_dir) if r["kind"] == "fates")
    assert fates.get("regenerated_rollout_worker_lost", 0) >= 1, fates  # its groups in flight came back


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_lost_reward_worker_is_replaced_and_the_run_finishes(tiny_task_model, tmp_path, ray_cluster, sig):
    """``reward.pool_size=1``: the reward's process (a forkserver child under the rollout worker)
    is SIGKILLed (or SIGSTOPped: found by the call waiting on it within a second, named) mid-run;
    the pool replaces it and retries the call, the run loses nothing."""
    cfg = load_config(None, [*_overrides(tiny_task_model, tmp_path, "reward"), "reward.pool_size=1"])
    forkserver = "from multiprocessing.forkserver import main"
    fault = _fault_after_step(tmp_path / "reward", "", sig, parent_title=forkserver)
    result = RLTrainer(cfg, reward=length_reward).fit()
    fault.join()
    _assert_each_sample_once(result.run_dir)
    rewards = next(r for r in _records(result.run_dir) if r["kind"] == "rewards")
    assert rewards["reward_worker_restarts"] >= 1, "the lost reward worker was not replaced"
    assert rewards["reward_worker_stopped"] == (sig == signal.SIGSTOP), rewards


@pytest.mark.parametrize(
    ("title", "sig", "worker"),
    [
        ("ray::TrainerWorker", signal.SIGKILL, "the trainer died"),
        ("ray::TrainerWorker", signal.SIGSTOP, "the trainer sent no heartbeat"),
    ],
    ids=["trainer-SIGKILL", "trainer-SIGSTOP"],
)
def test_a_lost_trainer_or_queue_stops_the_run_with_one_line_and_resume_finishes_it(
    tiny_task_model, tmp_path, ray_cluster, title, sig, worker
):
    """In-run recovery off (``run.max_restarts=0``): the stop's one line, then ``resume=auto`` by
    hand finishes the run (the queue's and the registry's deaths: ``test_in_run_recovery.py``)."""
    overrides = _overrides(tiny_task_model, tmp_path, "stopped", "run.max_restarts=0")  # the one line, then resume
    fault = _fault_after_step(tmp_path / "stopped", title, sig)
    started = time.monotonic()
    with pytest.raises(RunStopped) as stop:
        RLTrainer(load_config(None, overrides), reward=length_reward).fit()
    fault.join()
    assert worker in str(stop.value) and "resume=auto" in str(stop.value) and "\n" not in str(stop.value)
    assert time.monotonic() - started < 300
    resumed = RLTrainer(load_config(None, [*overrides, "run.resume=auto"]), reward=length_reward).fit()
    _assert_each_sample_once(resumed.run_dir)
    deadline = time.monotonic() + 30  # ray.kill returns before the process has exited
    while _actor_pids(title) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _actor_pids(title), "the stopped actor outlived its run"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_lost_engine_replica_is_replaced_and_the_run_finishes(tiny_task_model, tmp_path, ray_cluster, sig):
    """``resources.rollout.replica_actors``: one of the two engine replicas (an ``EngineHost`` actor) is
    SIGKILLed (or SIGSTOPped: silent for half the stall timeout, it is killed) mid-run; its
    requests continue on the other replica, a new replica joins with the newest weights, and the
    run loses nothing. A replica actor takes 10-15 s to start here, so the run is long enough for
    its replacement to join."""
    extra = (
        "resources.rollout.replica_actors=true",
        "resources.rollout.replicas=2",
        "run.steps=120",
        "run.checkpoint_every=60",
    )
    extra += ("run.stall_timeout_s=60",)  # a loaded machine can be slow to start the first step
    cfg = load_config(None, _overrides(tiny_task_model, tmp_path, "replica", *extra))
    fault = _fault_after_step(tmp_path / "replica", "ray::EngineHost", sig, step=1, of=2)
    result = RLTrainer(cfg, reward=length_reward).fit()
    fault.join()
    _assert_each_sample_once(result.run_dir, run_steps=120)
    proxy = next(r for r in _records(result.run_dir) if r["kind"] == "proxy")
    assert proxy.get("replicas_lost") == 1 and proxy.get("replicas_added") == 1, proxy
    assert proxy.get("replicas_silent", 0) == (sig == signal.SIGSTOP), proxy
